"""LeRobot 0.6.1's own HIL-SERL learner or actor (``lerobot.rl.learner.train_cli`` /
``lerobot.rl.actor.actor_cli``), configured in Python and observed from outside.

    python -m tools.bench.compare_lerobot.lerobot_entry learner|actor --out DIR --port P [--seconds S] ...

Nothing of LeRobot's is edited on disk. At run time this process:

- fills the ``dataset: null`` gap of LeRobot 0.6.1's validation (``TrainPipelineConfig.validate``
  reads ``self.dataset.repo_id`` although the RL pipeline's dataset is optional): a stand-in
  with no repo id is set during the call and removed after;
- wraps four functions to print one ``CMPEVENT {json}`` line each time they run, with the
  wall time: the learner's ``RLTrainer.training_step`` (``update``, one optimisation step =
  ``utd_ratio`` critic updates + the actor update), ``push_actor_policy_to_queue`` (``push``,
  weights handed to the gRPC server), ``process_transitions`` (``ingest``, the replay size
  when it grew); the actor's ``step_env_and_process_transition`` (``step``, reward, done)
  and ``bytes_to_state_dict`` (``load``: new weights loaded, acted with from the next step);
- with ``--drq 0`` (the comparison's choice: Tandem has no image augmentation), turns off the
  DrQ random shift (pad 4) that LeRobot's replay buffer applies to every sampled batch: no SAC
  or policy config field controls it; ``lerobot.rl.learner.initialize_replay_buffer`` builds
  ``ReplayBuffer(..., optimize_memory=True)`` with ``use_drq`` at its default, True, so the
  built buffer's ``use_drq`` is set to False;
- with ``--render fast``, renders gym-hil without shadow map and multisampling, as Tandem's
  ``env.render_quality=fast`` does (LeRobot's default is gym-hil's full quality);
- with ``--obs state`` (the comparison's ``pick_cube_state`` task), builds the actor's gym-hil
  env itself in place of ``make_robot_env`` (which always asks for images): the same registered
  ``gym_hil/PandaPickCube-v0`` with ``image_obs=False``, ``--reward-type``,
  ``--random-block``, ``--reset-delay-s`` (gym-hil's pause before each reset, for a human
  watching; 1 s by default) and the cube position appended to the 18-D robot state
  (``observation.state``, 21-D, as Tandem's ``env.include_env_state``); the gripper action
  is taken in [-1, 1] and shifted to gym-hil's [0, 2] (``--gripper-pm1``, as Tandem's env
  does; without it a tanh policy with LeRobot's identity action normalisation can only open
  or hold the gripper, never close it), and ``--fps 0`` leaves the actor's loop unpaced;
- stops itself after ``--seconds``.

gRPC binds 127.0.0.1 only. Otherwise the gym-hil env is LeRobot's (``make_robot_env``:
``image_obs=True``, its full-quality rendering; LeRobot has no state-only mode for gym-hil).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace


def emit(kind: str, **kw) -> None:
    print("CMPEVENT " + json.dumps({"ev": kind, "t": round(time.time(), 3), **kw}), flush=True)


def patch_validation() -> None:
    from lerobot.configs.train import TrainPipelineConfig

    orig = TrainPipelineConfig.validate
    if getattr(orig, "_cmp_patched", False):
        return

    def validate(self):
        if getattr(self, "dataset", None) is not None:
            return orig(self)
        self.dataset = SimpleNamespace(repo_id=None, eval_split=0.0)
        try:
            return orig(self)
        finally:
            self.dataset = None

    validate._cmp_patched = True  # type: ignore[attr-defined]
    TrainPipelineConfig.validate = validate


def build_config(args):
    """The pipeline config: gym-hil PandaPickCube (two 128x128 cameras + 18-D state, 4-D
    continuous action), gaussian_actor + SAC with the given sizes, gRPC on 127.0.0.1."""
    from lerobot.configs.types import FeatureType, PolicyFeature
    from lerobot.envs.configs import HILSerlProcessorConfig, HILSerlRobotEnvConfig
    from lerobot.policies.gaussian_actor.configuration_gaussian_actor import GaussianActorConfig
    from lerobot.rl.algorithms.sac.configuration_sac import SACAlgorithmConfig
    from lerobot.rl.train_rl import TrainRLServerPipelineConfig

    img = PolicyFeature(type=FeatureType.VISUAL, shape=(3, 128, 128))
    obs = getattr(args, "obs", "pixels")
    state_dim = STATE_DIM[obs]
    inputs = {"observation.state": PolicyFeature(type=FeatureType.STATE, shape=(state_dim,))}
    stats = {"observation.state": {"min": [-1.0] * state_dim, "max": [1.0] * state_dim},
             "action": {"min": [-1.0] * ACTION_DIM[obs], "max": [1.0] * ACTION_DIM[obs]}}
    if obs == "pixels":
        inputs = {"observation.images.front": img, "observation.images.wrist": img, **inputs}
        stats["observation.image"] = {"mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225]}
    policy = GaussianActorConfig(
        device="cpu", storage_device="cpu",
        input_features=inputs,
        output_features={"action": PolicyFeature(type=FeatureType.ACTION, shape=(ACTION_DIM[obs],))},
        dataset_stats=stats,
        latent_dim=args.latent_dim, image_encoder_hidden_dim=args.channels,
        image_embedding_pooling_dim=args.pool_features,
        freeze_vision_encoder=args.freeze_vision_encoder,
        online_steps=10_000_000, online_buffer_capacity=args.buffer,
        online_step_before_learning=args.learning_starts, push_to_hub=False,
    )
    policy.actor_network_kwargs.hidden_dims = list(args.hidden)
    policy.actor_learner_config.learner_host = "127.0.0.1"
    policy.actor_learner_config.learner_port = args.port
    policy.actor_learner_config.policy_parameters_push_frequency = args.push_s
    algo = SACAlgorithmConfig.from_policy_config(policy)
    algo.utd_ratio = args.utd
    algo.critic_network_kwargs.hidden_dims = list(args.hidden)
    # no ``processor.reset``: its ``fixed_reset_joint_positions: Any`` breaks draccus' encoding of
    # the config that the learner logs; gym-hil's own 100-step limit ends episodes instead
    # make_policy takes the output (action) features from the env config's features
    features = {"observation.state": PolicyFeature(type=FeatureType.STATE, shape=(state_dim,)),
                "action": PolicyFeature(type=FeatureType.ACTION, shape=(ACTION_DIM[obs],))}
    if obs == "pixels":
        features = {"observation.images.front": PolicyFeature(type=FeatureType.VISUAL, shape=(128, 128, 3)),
                    "observation.images.wrist": PolicyFeature(type=FeatureType.VISUAL, shape=(128, 128, 3)),
                    **features}
    # name gym_hil: LeRobot's gym-hil processor pipeline (also for the pendulum, whose env
    # the actor builds itself: pendulum_env)
    env = HILSerlRobotEnvConfig(name="gym_hil", task="PandaPickCube-v0", fps=int(getattr(args, "fps", 10)) or None,
                                processor=HILSerlProcessorConfig(), features=features,
                                features_map={k: k for k in features})
    return TrainRLServerPipelineConfig(
        env=env, policy=policy, algorithm=algo, output_dir=Path(args.out) / args.role,
        job_name=f"cmp_{args.role}", batch_size=args.batch, seed=args.seed, log_freq=1,
        save_checkpoint=False,
    )


#: observation.state size per ``--obs``: gym-hil's 18-D robot state (+ the cube's 3-D position);
#: the cart-pole's 4-D state
STATE_DIM = {"pixels": 18, "state": 21, "pendulum": 4}
ACTION_DIM = {"pixels": 4, "state": 4, "pendulum": 1}


def pendulum_env() -> None:
    """The actor's env for ``--obs pendulum``: Tandem's own ``tandem/InvertedPendulum-v0``
    (:mod:`envs.pendulum`: gymnasium's MuJoCo InvertedPendulum-v5, action in [-1, 1] scaled to
    the +-3 N actuator, 100-step limit, success = the pole kept up for all 100 steps), its
    observation renamed to the gym-hil layout LeRobot's processors read (``agent_pos``) and
    its success flag copied to ``info["succeed"]`` (gym-hil's name), so both systems run the
    very same env code."""
    import gymnasium as gym
    import numpy as np

    import lerobot.rl.actor as A

    class AsGymHil(gym.Wrapper):
        def __init__(self, env):
            super().__init__(env)
            self.observation_space = gym.spaces.Dict(
                {"agent_pos": gym.spaces.Box(-np.inf, np.inf, (STATE_DIM["pendulum"],), np.float32)})

        def reset(self, **kw):
            obs, info = self.env.reset(**kw)
            return {"agent_pos": obs["observation.state"]}, info

        def step(self, action):
            obs, r, term, trunc, info = self.env.step(np.asarray(action, dtype=np.float32))
            return {"agent_pos": obs["observation.state"]}, float(r), term, trunc, {**info, "succeed": info["is_success"]}

    def make_robot_env(cfg):
        from envs.pendulum import PENDULUM_ID

        env = AsGymHil(gym.make(PENDULUM_ID))
        emit("pendulum_env", id=PENDULUM_ID)
        return env, None

    A.make_robot_env = make_robot_env


def state_env(args) -> None:
    """The actor's env for ``--obs state``: gym-hil's registered PandaPickCube-v0 (its EE action
    and gripper wrappers, 100-step limit) without images, the cube position in the state."""
    import gymnasium as gym
    import numpy as np

    import lerobot.rl.actor as A

    class StateObs(gym.ObservationWrapper):
        def __init__(self, env):
            super().__init__(env)
            self.observation_space = gym.spaces.Dict(
                {"agent_pos": gym.spaces.Box(-np.inf, np.inf, (STATE_DIM["state"],), np.float32)})

        def observation(self, obs):
            return {"agent_pos": np.concatenate([obs["agent_pos"], obs["environment_state"]]).astype(np.float32)}

    class GripperPm1(gym.ActionWrapper):
        """Gripper action in [-1, 1] (-1 opens, +1 closes, 0 holds) -> gym-hil's [0, 2]."""

        def __init__(self, env):
            super().__init__(env)
            self.action_space = gym.spaces.Box(-1.0, 1.0, (4,), np.float32)

        def action(self, action):
            a = np.asarray(action, dtype=np.float32).copy()
            a[3] += 1.0
            return a

    class FloatReward(gym.RewardWrapper):
        """gym-hil's dense reward is a numpy scalar, which LeRobot's transition transport
        (``torch.load(weights_only=True)``) refuses: a Python float."""

        def reward(self, reward):
            return float(reward)

    def make_robot_env(cfg):
        import gym_hil  # noqa: F401 - registers the envs

        env = gym.make("gym_hil/PandaPickCube-v0", image_obs=False, use_gripper=True, gripper_penalty=0.0,
                       reward_type=args.reward_type, random_block_position=bool(args.random_block),
                       reset_delay_seconds=args.reset_delay_s)
        env = FloatReward(StateObs(env))
        if args.gripper_pm1:
            env = GripperPm1(env)
        emit("state_env", reward_type=args.reward_type, random_block=bool(args.random_block),
             reset_delay_s=args.reset_delay_s, gripper_pm1=bool(args.gripper_pm1))
        return env, None

    A.make_robot_env = make_robot_env


def instrument_learner(drq: bool = True) -> None:
    import lerobot.rl.learner as L
    from lerobot.rl.trainer import RLTrainer

    step, push, ingest = RLTrainer.training_step, L.push_actor_policy_to_queue, L.process_transitions
    init_buffer = L.initialize_replay_buffer

    def initialize_replay_buffer(*a, **k):
        buf = init_buffer(*a, **k)
        buf.use_drq = drq
        emit("buffer", drq=bool(buf.use_drq), optimize_memory=bool(buf.optimize_memory))
        return buf

    def training_step(self, *a, **k):
        out = step(self, *a, **k)
        emit("update")
        return out

    def push_policy(parameters_queue, algorithm):
        push(parameters_queue=parameters_queue, algorithm=algorithm)
        emit("push", step=int(getattr(algorithm, "optimization_step", -1)))

    def process_transitions(*a, **k):
        buf = k.get("replay_buffer", a[1] if len(a) > 1 else None)
        before = len(buf) if buf is not None else 0
        out = ingest(*a, **k)
        if buf is not None and len(buf) != before:
            emit("ingest", n=len(buf))
        return out

    RLTrainer.training_step = training_step
    L.push_actor_policy_to_queue = push_policy
    L.process_transitions = process_transitions
    L.initialize_replay_buffer = initialize_replay_buffer


def unpaced_actor() -> None:
    """``--fps 0``: ``env.fps`` is None, which LeRobot's actor loop reads as unpaced, but its
    per-step ``log_policy_frequency_issue`` compares with it; that log check is skipped."""
    import lerobot.rl.actor as A

    check = A.log_policy_frequency_issue

    def log_policy_frequency_issue(policy_fps, cfg, interaction_step):
        if cfg.env.fps is not None:
            check(policy_fps=policy_fps, cfg=cfg, interaction_step=interaction_step)

    A.log_policy_frequency_issue = log_policy_frequency_issue


def instrument_actor() -> None:
    import lerobot.rl.actor as A
    from lerobot.processor import TransitionKey

    step, load = A.step_env_and_process_transition, A.bytes_to_state_dict

    def step_env(*a, **k):
        tr = step(*a, **k)
        done = bool(tr.get(TransitionKey.DONE, False)) or bool(tr.get(TransitionKey.TRUNCATED, False))
        info = tr.get(TransitionKey.INFO) or {}
        ok = info.get("succeed")
        emit("step", r=float(tr[TransitionKey.REWARD]), done=done,
             **({"ok": bool(ok)} if ok is not None else {}))
        return tr

    def bytes_to_state_dict(*a, **k):
        out = load(*a, **k)
        emit("load")
        return out

    A.step_env_and_process_transition = step_env
    A.bytes_to_state_dict = bytes_to_state_dict


def fast_render() -> None:
    """Render gym-hil like Tandem's ``env.render_quality=fast``: no shadow map, no multisampling
    (the renderer rebuilt, as those are sized with its GL context); same scene and cameras."""
    import mujoco

    import lerobot.rl.actor as A

    make = A.make_robot_env

    def make_robot_env(cfg):
        env, teleop = make(cfg)
        base = env.unwrapped
        spec = base._render_specs
        base._viewer.close()
        base.model.vis.quality.shadowsize = 0
        base.model.vis.quality.offsamples = 0
        base._viewer = mujoco.Renderer(base.model, height=spec.height, width=spec.width)
        emit("fast_render")
        return env, teleop

    A.make_robot_env = make_robot_env


def stop_after(seconds: float) -> None:
    """Exit the whole process after ``seconds`` (LeRobot's loops run until interrupted)."""
    def run():
        time.sleep(seconds)
        emit("stop")
        os._exit(0)

    threading.Thread(target=run, daemon=True).start()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("role", choices=("learner", "actor"))
    ap.add_argument("--out", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--seconds", type=float, default=600.0)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--utd", type=int, default=2)
    ap.add_argument("--hidden", type=int, nargs="+", default=[256, 256])
    ap.add_argument("--latent-dim", type=int, default=256)
    ap.add_argument("--channels", type=int, default=32)
    ap.add_argument("--pool-features", type=int, default=8)
    ap.add_argument("--freeze-vision-encoder", type=int, default=1)
    ap.add_argument("--learning-starts", type=int, default=100)
    ap.add_argument("--buffer", type=int, default=100_000)
    ap.add_argument("--push-s", type=float, default=4.0)
    ap.add_argument("--drq", type=int, default=1, help="1: LeRobot's DrQ random shift on sampled "
                    "images (its default); 0: off")
    ap.add_argument("--seed", type=int, default=1000)
    ap.add_argument("--obs", choices=tuple(STATE_DIM), default="pixels",
                    help="pixels: LeRobot's gym-hil env (two 128x128 cameras + 18-D state); state: "
                         "no cameras, the cube position appended to the state (21-D); pendulum: "
                         "Tandem's InvertedPendulum (4-D state, 1-D action) in place of gym-hil")
    ap.add_argument("--reward-type", choices=("sparse", "dense"), default="sparse", help="--obs state: gym-hil's")
    ap.add_argument("--random-block", type=int, default=0, help="--obs state: gym-hil's random_block_position")
    ap.add_argument("--reset-delay-s", type=float, default=1.0, help="--obs state: gym-hil's pause before a reset")
    ap.add_argument("--gripper-pm1", type=int, default=0, help="--obs state: gripper action in [-1, 1]")
    ap.add_argument("--fps", type=float, default=10, help="the actor's pace (LeRobot's env.fps); 0: unpaced")
    ap.add_argument("--render", choices=("faithful", "fast"), default="faithful",
                    help="faithful: gym-hil's own rendering (LeRobot's); fast: as Tandem's fast")
    args = ap.parse_args(argv)
    stop_after(args.seconds)
    patch_validation()
    cfg = build_config(args)
    emit("start", role=args.role)
    if args.role == "learner":
        instrument_learner(drq=bool(args.drq))
        import lerobot.rl.learner as L

        L.train_cli(cfg)
    else:
        instrument_actor()
        if not args.fps:
            unpaced_actor()
        if args.obs == "state":
            state_env(args)
        elif args.obs == "pendulum":
            pendulum_env()
        elif args.render == "fast":
            fast_render()
        import lerobot.rl.actor as A

        A.actor_cli(cfg)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
