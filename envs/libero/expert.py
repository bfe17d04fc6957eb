"""A scripted LIBERO expert: pick-and-place planned from the simulator's privileged state.

:class:`PickPlaceExpert` drives LIBERO's own 7-D action space (OSC_POSE deltas: dx, dy, dz,
droll, dpitch, dyaw, scaled by the controller's 5 cm / 0.5 rad per unit, world axes; the
gripper: -1 opens, +1 closes) for goals of the form ``(On|In OBJECT TARGET)``: every
libero_spatial task ("pick up the black bowl ... and place it on the plate"). It reads, every
call, the object's and the target's poses, the gripper's pose, its fingers' opening and their
contacts with the object (:class:`envs.libero.scene.Scene`), and picks the action from that
state. Its memory is small: the grasp it chose for the episode and how long the gripper has
been closing. So it can take over from any state a policy left (``intervention.device=expert``),
holding the object or not, anywhere in the workspace.

The plan, each step, from the state:

* not holding the object: open the gripper; fly (high enough to clear every obstacle on the
  way, found by ray casts) over the grasp point, turned to the grasp's yaw; descend; close and
  hold still while the fingers close. Both fingers touching the object make a grasp; a close
  that ends without one re-opens and tries again.
* holding: rise to a carry height at which the object clears everything between it and the
  target, move over the target keeping the grasp offset, lower to just above it, release.

Grasps. A bowl-like object (a ring of wall geoms around its centre: LIBERO's bowls and
ramekins) is grasped by its wall, the fingers straddling the rim. Of eight grasps around the
rim (the gripper's yaw turned by 0, 90 or +-45 degrees, on either side) the expert takes the
one whose outer finger has the most room (the lowest obstacle where it goes down), preferring
no turn. Another object is grasped over its centre. A little integral action on the horizontal
error removes the ~1 cm the controller leaves at the edge of the workspace.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from envs.libero.scene import Scene

#: proportional gains: action units per metre of position error, per radian of rotation error
POS_GAIN = 12.0
ROT_GAIN = 5.0
#: the least translation command (action units) while more than 5 mm from the goal
MIN_SPEED = 0.3
#: integral gain on the horizontal error (action units per metre-step)
INTEGRAL_GAIN = 1.0
#: finger opening (qpos of one finger, metres) below which the gripper counts as closed (on a
#: thin wall), and above which as open
CLOSED_QPOS = OPEN_QPOS = 0.030
#: steps the gripper gets to close before the grasp is judged
CLOSE_STEPS = 8
#: how far fingertips (or a carried object's bottom) stay above obstacles on the way (metres)
CLEARANCE = 0.06
#: how far the open outer finger reaches beyond the grasp point (metres)
FINGER_REACH = 0.045
#: release heights of the grasp point above the target, for On / In goals (metres)
DROP_ON, DROP_IN = 0.06, 0.08
#: horizontal misalignment over the grasp point allowed before / while descending (metres)
XY_TOL, XY_TOL_DESCENT = 0.012, 0.03
#: rotation error (radians) above which the gripper turns before it descends
ROT_TOL = 0.15
#: room under the outer finger beyond which more does not matter (metres)
ROOM_ENOUGH = 0.03
#: the fastest descent onto a grasp or a target (action units: overshoot when faster)
DESCENT_SPEED = 0.6
#: horizontal distance from the robot's base it reaches comfortably, and the cost (per metre
#: beyond it) of a grasp that makes it reach further (metres)
REACH_OK, REACH_COST = 0.70, 0.5
#: steps without movement after which a move near its goal counts as blocked
STALL_STEPS = 8
#: yaw turns tried for a rim grasp, in order of preference (radians)
GRASP_YAWS = (0.0, np.pi / 2, np.pi / 4, -np.pi / 4)


@dataclass
class Grasp:
    """Where and how to grasp: ``offset`` from the object's position to the grip site (world
    axes), the gripper's yaw turn from its start orientation, and the room its outer finger
    has (metres between the fingertips' depth and the highest obstacle there)."""

    offset: np.ndarray
    yaw: float
    room: float


def _rz(yaw: float) -> np.ndarray:
    c, s = np.cos(yaw), np.sin(yaw)
    return np.array([[c, -s, 0.0], [s, c, 0.0], [0.0, 0.0, 1.0]])


def _rot_error(current: np.ndarray, goal: np.ndarray) -> np.ndarray:
    """Axis-angle (world frame) rotating ``current`` onto ``goal`` (3x3 matrices)."""
    r = goal @ current.T
    angle = np.arccos(np.clip((np.trace(r) - 1) / 2, -1.0, 1.0))
    axis = np.array([r[2, 1] - r[1, 2], r[0, 2] - r[2, 0], r[1, 0] - r[0, 1]])
    n = np.linalg.norm(axis)
    return np.zeros(3) if angle < 1e-6 or n < 1e-9 else axis / n * angle


class PickPlaceExpert:
    """The demonstrator of one :class:`envs.libero.env.LiberoEnv` (module docstring).

    :meth:`action` reads the env's current simulator state; :meth:`reset` (the env calls it
    on every reset) starts a new episode's plan. Raises ``ValueError`` for a goal it cannot
    plan (anything but one ``On``/``In`` of an object and a target).
    """

    def __init__(self, env):
        self.env = env
        self.scene: Scene | None = None
        self.phase = ""
        self.goal_pos: np.ndarray | None = None
        self._new_episode = True

    def goal(self) -> tuple[str, str, str]:
        """(predicate, object, target) of the task's goal."""
        goal = self.env._env.env.parsed_problem["goal_state"]
        if len(goal) != 1 or len(goal[0]) != 3 or goal[0][0].lower() not in ("on", "in"):
            raise ValueError(f"the scripted LIBERO expert plans one (on|in object target) goal; "
                             f"task {self.env.task.name!r} has {goal}")
        pred, obj, target = goal[0]
        return pred.lower(), obj, target

    def reset(self) -> None:
        self._new_episode = True

    # -- grasps -----------------------------------------------------------------------------------
    def _grasp(self, obj: str) -> Grasp:
        """The grasp of the module docstring for the object where it lies now."""
        sc = self.scene
        offs = sc.geom_offsets(obj)
        radial = np.linalg.norm(offs[:, :2], axis=1)
        top = float(offs[:, 2].max())
        pos = sc.body_pos(obj)
        ring = len(offs) >= 12 and radial.max() > 0.03 and np.median(radial) > 0.5 * radial.max()
        # a bowl is open: straight down its middle the first surface is its floor, not a lid
        ring = ring and sc.surface_z(pos[:2], sc.all_but(obj)) < pos[2] + 0.5 * top
        if not ring:
            return Grasp(np.array([0.0, 0.0, max(sc.object_top(obj) - pos[2] - 0.02, 0.01)]), 0.0, 0.0)
        r = float(radial.max())
        depth = pos[2] + top + 0.004 - 0.012          # fingertip height at the grasp
        target = sc.body_pos(self.goal()[2])
        options = []
        for k, yaw in enumerate(GRASP_YAWS):
            axis = _rz(yaw) @ self._axis0
            for u in (axis, -axis):
                outer = pos + u * (r + FINGER_REACH)
                room = depth - sc.patch_height(outer, u[:2], 0.02, 0.03, self._skip)
                # the arm's reach at the pick and at the drop (grasp offset kept)
                reach = max(np.linalg.norm((p + u * r - self._base)[:2]) for p in (pos, target))
                score = min(room, ROOM_ENOUGH) - REACH_COST * max(reach - REACH_OK, 0.0) - 0.002 * k
                options.append((score, Grasp(np.array([0.0, 0.0, top + 0.004]) + u * (r - 0.004), yaw, room)))
        return max(options, key=lambda o: o[0])[1]

    def _start(self) -> None:
        self.scene = Scene(self.env._env.env)
        _, obj, _ = self.goal()
        self._skip = self.scene.robot_and(obj)
        _, self._home_rot = self.scene.grip_pose()
        self._axis0 = self.scene.closing_axis()
        self._base = self.scene.robot_base()
        self._grasp_plan = self._grasp(obj)
        self._grasp_at = self.scene.body_pos(obj)
        self._closing = 0
        self._holding = False
        self._grip_width: float | None = None
        self._hang = 0.0
        self._xy_goal: np.ndarray | None = None
        self._integral = np.zeros(2)
        self._trail: list[np.ndarray] = []
        self.phase = ""
        self._new_episode = False

    # -- the plan ---------------------------------------------------------------------------------
    def action(self) -> np.ndarray:
        """The expert's action for the env's current state (float32 [7], in [-1, 1])."""
        if self._new_episode or self.scene is None or self.scene.inner is not self.env._env.env:
            self._start()
        sc = self.scene
        pred, obj, target = self.goal()
        ee, ee_rot = sc.grip_pose()
        self._trail = (self._trail + [ee])[-STALL_STEPS:]
        opos, tpos = sc.body_pos(obj), sc.body_pos(target)
        opening, both, either = sc.fingers(obj)
        # a grasp is made when both fingers touch the object after the gripper closed on it; it
        # lasts while either finger still does and the gripper has not opened past the grasp
        if both and not self._holding and (opening < CLOSED_QPOS or self._closing >= CLOSE_STEPS):
            self._grip_width = opening
            # how far the load hangs below the grip: down to what it stands on now
            self._hang = ee[2] - sc.surface_z(opos[:2], self._skip)
        holding = either and self._grip_width is not None and opening < self._grip_width + 0.004 and \
            (both or self._holding)
        if not holding:
            self._grip_width = None
        self._holding = holding
        if holding:
            self._closing = CLOSE_STEPS
            carry = ee - opos                          # the grasp offset, kept while carrying
            drop = tpos + carry
            drop[2] += DROP_ON if pred == "on" else DROP_IN
            xy_err = np.linalg.norm(drop[:2] - ee[:2])
            # high enough that the load's bottom clears everything on the way
            transit = max(sc.path_height(ee, drop, self._skip, 0.05) + self._hang + CLEARANCE, drop[2])
            if xy_err > 0.02 and not self._stalled(np.array([drop[0], drop[1], transit]), 0.04):
                if ee[2] < transit - 0.03:
                    return self._command(np.array([ee[0], ee[1], transit]), 1.0, "lift")
                return self._command(np.array([drop[0], drop[1], transit]), 1.0, "carry")
            if ee[2] > drop[2] + 0.01 and not self._stalled(drop, 0.03):
                return self._command(drop, 1.0, "lower", DESCENT_SPEED)
            self._closing = 0
            return self._command(drop, -1.0, "release")

        # not holding: open, fly over the grasp point, turn, descend, close
        if np.linalg.norm(opos - self._grasp_at) > 0.03 and not self._closing:
            self._grasp_plan, self._grasp_at = self._grasp(obj), opos   # it moved: plan again
        g = self._grasp_plan
        grasp = opos + g.offset
        xy_err = np.linalg.norm(grasp[:2] - ee[:2])
        if self._closing:
            self._closing += 1
            if self._closing > CLOSE_STEPS + 6:          # closed without a grasp: open, retry
                self._closing = 0
                return self._command(ee + np.array([0.0, 0.0, 0.02]), -1.0, "regrasp")
            return self._command(grasp, 1.0, "close")
        if opening < OPEN_QPOS:                          # open first, lifting clear of the object
            return self._command(np.array([ee[0], ee[1], max(ee[2], grasp[2] + 0.02)]), -1.0, "open")
        turned = np.linalg.norm(_rot_error(ee_rot, self._goal_rot())) < ROT_TOL
        if xy_err > (XY_TOL_DESCENT if self.phase in ("descend", "close") else XY_TOL) or not turned:
            over = sc.path_height(ee, grasp, self._skip, 0.05) + CLEARANCE if xy_err > XY_TOL else 0.0
            approach = np.array([grasp[0], grasp[1], max(over, grasp[2] + 0.10)])
            if ee[2] < approach[2] - 0.03 and xy_err > 0.03:
                return self._command(np.array([ee[0], ee[1], approach[2]]), -1.0, "rise")
            return self._command(approach, -1.0, "approach")
        if np.linalg.norm(grasp - ee) > 0.008 and not self._stalled(grasp, 0.02):
            return self._command(grasp, -1.0, "descend", DESCENT_SPEED)
        self._closing = 1
        return self._command(grasp, 1.0, "close")

    def _stalled(self, goal: np.ndarray, near: float) -> bool:
        """The end effector moved under 2 mm over the last ``STALL_STEPS`` steps while within
        ``near`` metres of ``goal`` (blocked by contact: go on with the next phase)."""
        t = self._trail
        return len(t) == STALL_STEPS and np.linalg.norm(t[0] - t[-1]) < 0.002 and \
            np.linalg.norm(goal - t[-1]) < near

    def _goal_rot(self) -> np.ndarray:
        return _rz(self._grasp_plan.yaw) @ self._home_rot

    def _command(self, goal: np.ndarray, grip: float, phase: str, speed: float = 1.0) -> np.ndarray:
        ee, ee_rot = self.scene.grip_pose()
        self.phase, self.goal_pos = phase, goal
        err = goal - ee
        dist = float(np.linalg.norm(err))
        # proportional, never slower than MIN_SPEED until within 5 mm
        gain = max(POS_GAIN, MIN_SPEED / dist) if dist > 0.005 else POS_GAIN
        # the integral runs while the horizontal goal stays put and is near
        xy = err[:2]
        if self._xy_goal is not None and np.linalg.norm(goal[:2] - self._xy_goal) < 0.005 \
                and np.linalg.norm(xy) < 0.03:
            self._integral = np.clip(self._integral + xy, -0.1, 0.1)
        else:
            self._integral = np.zeros(2)
        self._xy_goal = goal[:2].copy()
        a = np.zeros(7, np.float32)
        a[:3] = gain * err
        if np.linalg.norm(a[:3]) > speed:
            a[:3] *= speed / np.linalg.norm(a[:3])
        a[:2] += INTEGRAL_GAIN * self._integral
        a[3:6] = ROT_GAIN * _rot_error(ee_rot, self._goal_rot())
        a[6] = grip
        return np.clip(a, -1.0, 1.0)
