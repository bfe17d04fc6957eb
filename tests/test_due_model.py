"""tools/bench/due_model.py: the batching model of closed-loop actors over the real Arrivals."""

from tools.bench.due_model import linear_forward, main, simulate


def test_lingering_a_whole_cycle_serves_out_of_phase_actors_together():
    kw = dict(seconds=60.0, sd_ms=30.0, think_ms=(198.0, 219.0), forward=linear_forward(20.0, 57.0))
    none, short, cycle = (simulate(d, **kw) for d in (0.0, 100.0, 400.0))
    assert none["mean_batch"] < 1.5                       # a 2-ms window: one or two at a time
    assert short["mean_batch"] > 2 * none["mean_batch"]
    assert cycle["mean_batch"] > 6.0 > short["mean_batch"]  # groups half a cycle apart merge
    assert cycle["gpu_share"] < short["gpu_share"] < none["gpu_share"]
    assert sum(int(b) * c for b, c in cycle["batch_sizes"].items()) / sum(cycle["batch_sizes"].values()) \
        == cycle["mean_batch"]


def test_in_step_actors_with_no_spread_are_served_whole_even_with_a_short_linger():
    r = simulate(100.0, seconds=30.0, sd_ms=0.0, think_ms=(200.0, 200.0), chunks_per_episode=10 ** 6)
    assert r["mean_batch"] > 7.0 and r["batch_sizes"]["8"] > 0.9 * sum(r["batch_sizes"].values())


def test_the_command_line_prints_a_row_per_due_setting(tmp_path, capsys):
    rows = main(["--due-ms", "0,300", "--seconds", "20", "--seeds", "1", "--json", str(tmp_path / "m.json")])
    assert [r["due_ms"] for r in rows] == [0.0, 300.0]
    assert "batch_due_ms   300" in capsys.readouterr().out and (tmp_path / "m.json").exists()
