"""Privileged reads of a LIBERO scene for the scripted expert (:mod:`envs.libero.expert`).

:class:`Scene` wraps the inner robosuite env of a :class:`envs.libero.env.LiberoEnv` and
answers geometric questions from the simulator's state: where a body is, which collision
geoms make up an object, how high the highest obstacle is under a point (a MuJoCo ray cast
that skips chosen bodies), whether the gripper's fingers touch an object, and how far they
are open. Nothing here changes the simulation.
"""

from __future__ import annotations

import numpy as np

#: robosuite puts collision geoms in group 0 (visual ones in group 1)
_COLLISION_GROUP = np.array([1, 0, 0, 0, 0, 0], np.uint8)
_ROBOT_PREFIXES = ("robot0_", "gripper0_", "mount0_")
GRIP_SITE = "gripper0_grip_site"


class Scene:
    """Geometry queries on one built LIBERO scene (see the module docstring)."""

    def __init__(self, inner):
        self.inner = inner
        self.sim = inner.sim
        self.model = inner.sim.model
        self._geoms: dict[str, list[int]] = {}
        self._site = self.model.site_name2id(GRIP_SITE)
        robot = inner.robots[0]
        self._finger_q = list(robot._ref_gripper_joint_pos_indexes)
        pads = robot.gripper.important_geoms
        self._left = {self.model.geom_name2id(g) for g in pads["left_finger"]}
        self._right = {self.model.geom_name2id(g) for g in pads["right_finger"]}

    # -- poses ------------------------------------------------------------------------------------
    def body_pos(self, name: str) -> np.ndarray:
        """World position of an object, a fixture or a region site, by its BDDL name."""
        inner, d = self.inner, self.sim.data
        if name in inner.objects_dict:
            return np.array(d.body_xpos[self.model.body_name2id(inner.objects_dict[name].root_body)])
        if name in getattr(inner, "object_sites_dict", {}):
            return np.array(d.get_site_xpos(name))
        return np.array(d.body_xpos[inner.obj_body_id[name]])

    def grip_pose(self) -> tuple[np.ndarray, np.ndarray]:
        """(position [3], rotation matrix [3, 3]) of the gripper site, world frame."""
        d = self.sim.data
        return np.array(d.site_xpos[self._site]), np.array(d.site_xmat[self._site]).reshape(3, 3)

    def robot_base(self) -> np.ndarray:
        """World position of the robot's base."""
        return np.array(self.sim.data.body_xpos[self.model.body_name2id("robot0_base")])

    def closing_axis(self) -> np.ndarray:
        """Unit vector (world xy plane) along which the fingers close, left to right finger."""
        d = self.sim.data
        left = d.body_xpos[self.model.body_name2id("gripper0_leftfinger")]
        right = d.body_xpos[self.model.body_name2id("gripper0_rightfinger")]
        v = np.array([right[0] - left[0], right[1] - left[1], 0.0])
        return v / (np.linalg.norm(v) + 1e-9)

    # -- objects ----------------------------------------------------------------------------------
    def _root(self, name: str) -> int:
        return self.model.body_name2id(self.inner.objects_dict[name].root_body)

    def _under(self, body: int, root: int) -> bool:
        while body not in (0, root):
            body = self.model.body_parentid[body]
        return body == root

    def object_geoms(self, name: str) -> list[int]:
        """Collision geoms of object ``name`` (its body and every body below it)."""
        if name not in self._geoms:
            m, root = self.model, self._root(name)
            self._geoms[name] = [g for g in range(m.ngeom)
                                 if m.geom_contype[g] != 0 and self._under(m.geom_bodyid[g], root)]
        return self._geoms[name]

    def geom_offsets(self, name: str) -> np.ndarray:
        """Centres of the object's collision geoms relative to its body position [N, 3]."""
        d = self.sim.data
        return np.array([d.geom_xpos[g] for g in self.object_geoms(name)]) - self.body_pos(name)

    def all_but(self, name: str) -> set[int]:
        """Body ids of everything but object ``name``: a ray cast that sees only it."""
        root = self._root(name)
        return {b for b in range(self.model.nbody) if not self._under(b, root)}

    def object_top(self, name: str) -> float:
        """Height of object ``name``'s highest point (a ray cast straight down on it alone)."""
        pos = self.body_pos(name)
        skip = self.all_but(name)
        return max(self.surface_z(pos[:2] + d, skip) for d in
                   (np.zeros(2), np.array([0.01, 0.0]), np.array([-0.01, 0.0]), np.array([0.0, 0.01]),
                    np.array([0.0, -0.01])))

    def robot_and(self, name: str) -> set[int]:
        """Body ids of the robot and of object ``name``: what a ray cast for its grasp skips."""
        m, root = self.model, self._root(name)
        return {b for b in range(m.nbody)
                if self._under(b, root) or (m.body_id2name(b) or "").startswith(_ROBOT_PREFIXES)}

    # -- obstacles --------------------------------------------------------------------------------
    def surface_z(self, xy: np.ndarray, skip: set[int]) -> float:
        """Height of the highest collision surface under ``xy`` (bodies in ``skip`` ignored;
        0 where nothing is hit)."""
        import mujoco

        m, d = self.model._model, self.sim.data._data
        pnt = np.array([xy[0], xy[1], 2.0])
        down = np.array([0.0, 0.0, -1.0])
        gid = np.zeros(1, np.int32)
        for _ in range(256):   # walk down through the skipped bodies' geoms
            dist = mujoco.mj_ray(m, d, pnt, down, _COLLISION_GROUP, 1, -1, gid)
            if dist < 0:
                return 0.0
            z = pnt[2] - dist
            if int(m.geom_bodyid[gid[0]]) not in skip:
                return float(z)
            pnt = np.array([xy[0], xy[1], z - 1e-4])
        return float(pnt[2])

    def patch_height(self, centre: np.ndarray, u: np.ndarray, half_u: float, half_v: float,
                     skip: set[int]) -> float:
        """The highest surface in a rectangle around ``centre`` (xy), ``half_u`` along the unit
        vector ``u`` and ``half_v`` across it."""
        v = np.array([-u[1], u[0]])
        pts = [centre[:2] + u[:2] * a + v * b for a in np.linspace(-half_u, half_u, 3)
               for b in np.linspace(-half_v, half_v, 3)]
        return max(self.surface_z(p, skip) for p in pts)

    def path_height(self, a: np.ndarray, b: np.ndarray, skip: set[int], width: float) -> float:
        """The highest surface along the segment ``a`` -> ``b`` (xy), ``width`` to either side."""
        d = b[:2] - a[:2]
        n = max(int(np.linalg.norm(d) / 0.015), 1)
        side = np.array([-d[1], d[0]]) / (np.linalg.norm(d) + 1e-9) * width
        pts = [a[:2] + d * k / n + side * o for k in range(n + 1) for o in (-1.0, 0.0, 1.0)]
        return max(self.surface_z(p, skip) for p in pts)

    # -- the gripper ------------------------------------------------------------------------------
    def fingers(self, name: str) -> tuple[float, bool, bool]:
        """(opening of one finger in metres, both fingers touch object ``name``, either does)."""
        d = self.sim.data
        opening = float(np.abs(np.asarray(d.qpos[self._finger_q])).mean())
        geoms = set(self.object_geoms(name))
        left = right = False
        for i in range(d.ncon):
            c = d.contact[i]
            pair = {c.geom1, c.geom2}
            if pair & geoms:
                left |= bool(pair & self._left)
                right |= bool(pair & self._right)
        return opening, left and right, left or right
