"""Gymnasium wrappers shared by every Tandem env.

All of them keep ``terminated`` (the task ended: success, failure, a safety stop) and
``truncated`` (a time limit or an outside interruption) apart, and work on the common
observation dict of :mod:`data.core.schema`.

* :class:`ImageTransform`      crop and/or resize every ``observation.images.*`` entry (images)
* :class:`ObsRemap`            map a foreign observation dict onto the common schema (remap)
* :class:`SuccessReward`       0/1 reward from ``info["is_success"]``; terminate on success
                               (success)
* :class:`TimeLimit`           truncate after N steps; exposes ``spec.max_episode_steps``
                               (time_limit)
* :class:`SafetyWrapper`       clip actions, zero translations that leave the workspace,
                               refuse non-finite actions (safety)
* :class:`ActionChunkWrapper`  execute the first k of an [H, A] action chunk in one call
                               (chunking)
* :class:`EpisodeRecorder`     write each episode as a ``.npz`` (transition layout) (recorder)
* :class:`RewardClassifierReward`  reward from a trained image classifier (see
                               ``tools/train_reward_classifier.py``) (reward_classifier)
"""

from envs.wrappers.chunking import ActionChunkWrapper
from envs.wrappers.images import ImageTransform, crop_image, resize_image
from envs.wrappers.recorder import EpisodeRecorder, load_episode
from envs.wrappers.remap import TEXT_SPACE, ObsRemap
from envs.wrappers.reward_classifier import RewardClassifier, RewardClassifierReward
from envs.wrappers.safety import SafetyWrapper
from envs.wrappers.success import SuccessReward
from envs.wrappers.time_limit import TimeLimit, has_time_limit

__all__ = [
    "ImageTransform", "ObsRemap", "SuccessReward", "TimeLimit", "SafetyWrapper",
    "ActionChunkWrapper", "EpisodeRecorder", "RewardClassifierReward", "RewardClassifier",
    "has_time_limit", "resize_image", "crop_image", "load_episode", "TEXT_SPACE",
]
