"""Checkpoints: nested state with tensors, int-keyed optimizer state, atomic replacement."""

import json

import pytest
import torch

from learner.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint


def _state(x):
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    return {"agent": {"model": model.state_dict(), "opt": opt.state_dict()},
            "counters": {"updates": x, "name": "run", "none": None, "ratio": 0.5}}


def test_round_trip_keeps_tensors_int_keys_and_plain_values(tmp_path):
    state = _state(7)
    path = save_checkpoint(tmp_path, 7, state)
    back = load_checkpoint(path)
    assert back["counters"] == state["counters"]
    assert set(back["agent"]["opt"]["state"]) == set(state["agent"]["opt"]["state"])  # int keys
    for k, v in state["agent"]["model"].items():
        assert torch.equal(back["agent"]["model"][k], v)
    opt = torch.optim.Adam(torch.nn.Linear(3, 2).parameters())
    opt.load_state_dict(back["agent"]["opt"])  # torch accepts what comes back


def test_a_half_written_checkpoint_never_replaces_the_latest(tmp_path):
    first = save_checkpoint(tmp_path, 1, _state(1))
    # a learner killed mid-write leaves a temporary folder behind; latest still points at step 1
    (tmp_path / ".tmp_step_0000000002_999").mkdir()
    (tmp_path / ".tmp_step_0000000002_999" / "state.json").write_text("{")
    assert latest_checkpoint(tmp_path) == first
    second = save_checkpoint(tmp_path, 2, _state(2))
    assert latest_checkpoint(tmp_path) == second
    assert json.loads((second / "state.json").read_text())["counters"]["updates"] == 2


def test_keeps_only_the_newest_and_refuses_what_it_cannot_store(tmp_path):
    for step in range(4):
        save_checkpoint(tmp_path, step, _state(step), keep=2)
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_0000000002", "step_0000000003"]
    with pytest.raises(TypeError, match="cannot store object"):
        save_checkpoint(tmp_path, 9, {"bad": object()})
    with pytest.raises(FileNotFoundError, match="not a Tandem checkpoint"):
        load_checkpoint(tmp_path / "nowhere")


def test_half_written_checkpoints_of_killed_processes_are_cleared(tmp_path):
    from learner.checkpoint import latest_checkpoint, save_checkpoint

    stale = tmp_path / ".tmp_step_0000000007_999999"  # a learner killed mid-write
    stale.mkdir()
    (stale / "tensors.safetensors").write_bytes(b"partial")
    final = save_checkpoint(tmp_path, 8, {"x": torch.ones(2)})
    assert not stale.exists() and latest_checkpoint(tmp_path) == final
