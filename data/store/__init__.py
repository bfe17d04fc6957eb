"""LeRobot-backed episode store: every finished episode goes into a LeRobot v3.0 dataset.

The dataset lives in the run directory (``<run_dir>/dataset`` by default) and is written
through ``lerobot``'s own dataset writer (``LeRobotDataset.create / resume``, ``add_frame``,
``save_episode``), so ``LeRobotDataset(repo_id, root=...)`` and every lerobot tool load it.
One Tandem record (:mod:`data.core.schema`) is one dataset frame:

=========================== ========================== =====================================
frame feature               dtype / shape              from the record
=========================== ========================== =====================================
observation.state           float32 [S]                observation.state
observation.images.<cam>    video or image [H, W, 3]   observation.images.<cam> (uint8)
action                      float32 [A]                action
next.reward                 float32 [1]                reward
next.terminated             bool [1]                   terminated
next.truncated              bool [1]                   truncated (kept apart)
next.success                bool [1]                   success
intervened                  bool [1]                   intervened
is_last                     bool [1]                   is_last (final observation record)
policy_version              int64 [1]                  policy_version
actor_id                    string                     the batch's actor id
actor_episode               int64 [1]                  episode (the actor's episode id)
actor_seq                   int64 [1]                  the record's sequence number
chunk_start                 bool [1]                   chunk_start
chunk_index                 int64 [1]                  chunk_index
group_id                    int64 [1]                  group_id (-1: no job)
extra.<name>                the extra's dtype, shape   extra.<name>, one per policy extra of
                            (a scalar stored as [1])   the spec (:attr:`EnvSpec.extras`)
task (LeRobot task)         tasks.parquet              task instruction
=========================== ========================== =====================================

``frame_index`` equals the record's ``step``. Each episode ends with its ``is_last`` frame
(action zeros): it carries the final observation, which a truncated episode needs for
bootstrapping. Tools that want (obs, action) pairs only drop ``is_last`` frames. A dataset
whose features differ from the ones this run writes (another env spec, other policy
extras, video instead of images) is refused with an error naming the differing features,
and left as it is.

Durability
----------
An episode is **durable** once a *commit* that contains it has completed: its parquet rows,
its video (or image) data and its episode metadata are in files that have been closed and
fsynced, and ``.tandem/commit.json`` -- written to a temporary name, fsynced, atomically
renamed, directory fsynced -- names the dataset state that includes it. Only then does the
store report it durable (``on_durable``), and only then does the learner acknowledge its
records to the actor (:mod:`learner.ingest`); until then the actor's spool keeps them.

Crash safety: a commit never modifies a file that an earlier commit made durable. After
each commit the writer is *sealed*: its parquet writers are closed and the next episode
starts new data / metadata / video files. ``meta/info.json``, ``stats.json`` and
``tasks.parquet`` (which lerobot rewrites in place) are copied into the commit record. On
open, :meth:`EpisodeStore.recover` deletes every data, metadata and video file that no
commit names and restores the three metadata files from the record, so a learner killed at
any instant (SIGKILL mid-write included) restarts with a dataset that loads and holds
exactly the committed episodes: an episode is never half present.

Disk full (or any OSError while writing): the commit is rolled back the same way (its new
files deleted, metadata restored), the error is logged with the free space, the episodes
stay queued and unacknowledged, and the writer retries with backoff. Training goes on from
the in-memory buffer, and earlier episodes stay readable.

Reading
-------
:func:`read_episodes` reads any local LeRobot v3.0 dataset (Tandem's or not) with pyarrow
and decodes each video file once, sequentially, with PyAV (no per-frame seeking).
:meth:`EpisodeStore.load_into` refills a replay buffer with the newest committed episodes,
up to its capacity.

Modules: :mod:`~data.store.features` (the table above, both ways), :mod:`~data.store.writer`
(:class:`EpisodeStore`), :mod:`~data.store.worker` (its queue and thread),
:mod:`~data.store.prepare` (the pool encoder's worker processes: stats and videos prepared
ahead, staged in ``.tandem/staging``, which is never part of a commit),
:mod:`~data.store.append` (appending prepared episodes at commit time),
:mod:`~data.store.commit` (commit records, recovery), :mod:`~data.store.compat` (lerobot
internals), :mod:`~data.store.reader` (reading datasets).
"""

from data.fsutil import is_disk_full
from data.store.episode import Episode
from data.store.features import (DEFAULT_REPO_ID, SCALAR_FEATURES, StoreError, build_features,
                                 features_diff)
from data.store.reader import (DatasetEpisode, read_episode_table, read_episodes, read_info,
                               read_tasks, tandem_batch)
from data.store.writer import EpisodeStore

__all__ = [
    "DEFAULT_REPO_ID", "DatasetEpisode", "Episode", "EpisodeStore", "SCALAR_FEATURES",
    "StoreError", "build_features", "features_diff", "is_disk_full", "read_episode_table",
    "read_episodes", "read_info", "read_tasks", "tandem_batch",
]
