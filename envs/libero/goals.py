"""Forcing a LIBERO task's goal state, for tests and tools (not for training).

:func:`force_goal_state` exercises the success predicates and everything downstream of
them without a policy that can solve the task.
"""

from __future__ import annotations

import numpy as np

from envs.libero.env import DUMMY_ACTION, LiberoEnv


def _joints_of(inner, name: str) -> list[str]:
    if name in inner.object_sites_dict:
        return list(inner.object_sites_dict[name].joints)
    return list(inner.get_object(name).joints)


def _target_pos(inner, name: str) -> np.ndarray:
    state = inner.object_states_dict[name]
    if state.object_state_type == "site":
        return np.array(inner.sim.data.get_site_xpos(name))
    return np.array(inner.sim.data.body_xpos[inner.obj_body_id[name]])


def force_goal_state(env: LiberoEnv, settle_steps: int = 15, lift: float = 0.04) -> bool:
    """Put the scene into a state that satisfies the task's goal, for tests and tools.

    Articulated goals (``Open``, ``Close``, ``Turnon``, ``Turnoff``) set the joint to a value
    in its range for which LIBERO's predicate holds; ``On``/``In`` goals teleport the object
    ``lift`` metres above the target (an object or a region site) and let it drop for
    ``settle_steps`` no-op control steps. Returns ``check_success()``; the env's last
    observation is refreshed. Not a physically achieved success: it only exercises the
    success predicates and everything downstream of them.
    """
    from libero.libero.envs.predicates import eval_predicate_fn

    inner = env._ensure_env().env
    sim = inner.sim
    goal = inner.parsed_problem["goal_state"]
    unary = [g for g in goal if len(g) == 2]
    binary = [g for g in goal if len(g) == 3]
    for pred, name in unary:
        joints = _joints_of(inner, name)
        state = inner.object_states_dict[name]
        for jname in joints:
            jid = sim.model.joint_name2id(jname)
            lo, hi = sim.model.jnt_range[jid]
            if lo >= hi:
                lo, hi = -np.pi, np.pi
            for v in np.linspace(lo, hi, 41):
                sim.data.set_joint_qpos(jname, v)
                sim.forward()
                if eval_predicate_fn(pred.lower(), state):
                    break
    for k, (_pred, obj, target) in enumerate(binary):
        pos = _target_pos(inner, target)
        body = inner.get_object(obj)
        jname = body.joints[-1]
        qpos = np.array(sim.data.get_joint_qpos(jname))
        # several objects into one container: spread them a little
        offset = np.array([0.03 * ((k % 3) - 1), 0.03 * ((k // 3) - 0), 0.0]) if len(binary) > 1 else 0.0
        qpos[:3] = pos + np.array([0.0, 0.0, lift]) + offset
        sim.data.set_joint_qpos(jname, qpos)
        sim.data.set_joint_qvel(jname, np.zeros(6))
        sim.forward()
    for _ in range(settle_steps if binary else 0):
        env._env.step(DUMMY_ACTION)
    env.observe()
    return env.check_success()
