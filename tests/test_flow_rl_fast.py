"""The flow-RL act (agents/policies/pi0/flow_rl.py) on PI0's fast path
(agents/policies/pi0/fast_chain.py): on a CPU (``fast_serving=eager``: the fast sampler without
graphs) it equals the eager act through lerobot's modules (``fast_serving=off``) on the same x_0,
step noise and SDE step, and its extras give back its log-prob at update time; on a GPU the chain
runs as CUDA graphs that equal the same computation run without graphs, and new noise-head
weights reach the next replay without a new capture."""

import pytest
import torch

from agents import registry
from agents.policies.pi0.fast_chain import FastPiChainSampler
from data.core.spec import EnvSpec
from tools.make_tiny_checkpoints import make_pi0

# the tiny checkpoints of tests/test_flow_rl.py
SPEC = EnvSpec(state_dim=4, action_dim=2, cameras={"image": (32, 32, 3)}, has_task=True)
CHUNK, STEPS = 4, 4
CASES = [("pi0", "noise"), ("pi0", "sde"), ("pi05", "noise"), ("pi05", "sde")]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("flow_rl_fast")
    return {v: make_pi0(root / v, SPEC, variant=v, chunk_size=CHUNK) for v in ("pi0", "pi05")}


def build(ckpt, variant, mode, **kw):
    """A flow-RL policy with every trainable tensor moved off its start (LoRA B included, so the
    adapters count; the noise head, so its std depends on the features), in eval mode."""
    cfg = {"name": variant, "checkpoint": str(ckpt), "chunk_size": CHUNK, "lora_rank": 4,
           "num_inference_steps": STEPS, "flow_rl": mode, "device": "cpu", "fast_serving": "eager", **kw}
    p = registry.build_policy(cfg, SPEC)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for q in p.parameters():
            if q.requires_grad:
                q.add_(0.05 * torch.randn(q.shape, generator=g).to(q))
    return p.eval()


@pytest.fixture(scope="module")
def policies(ckpts):
    """One policy per (variant, mode), built on first use (tests set ``cfg.fast_serving`` and restore it)."""
    made = {}

    def get(variant, mode):
        if (variant, mode) not in made:
            made[variant, mode] = build(ckpts[variant], variant, mode)
        return made[variant, mode]

    return get


def obs(b=3, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return {"observation.state": torch.randn(b, 4, generator=g).to(device),
            "task": (["reach the red target", "reach the blue target", "x"] * b)[:b],
            "observation.images.image": torch.randint(0, 256, (b, 32, 32, 3), dtype=torch.uint8,
                                                      generator=g).to(device)}


def randomness(p, b, seed=5, device="cpu"):
    """x_0 [B, H, D], step noise [B, K, H, A] and SDE steps [B] (every step is hit across rows)."""
    g = torch.Generator().manual_seed(seed)
    noise = torch.randn(b, CHUNK, p.max_dim, generator=g)
    eps = torch.randn(b, STEPS, CHUNK, SPEC.action_dim, generator=g)
    k_star = (torch.arange(b) + seed) % STEPS
    return noise.to(device), eps.to(device), k_star.to(device)


class ChainCalls:
    """Counts the chains the policy's fast sampler runs (each call goes through to it)."""

    def __init__(self, p):
        with torch.no_grad():
            self.n, fast = 0, p._fast_sampler()
        assert isinstance(fast, FastPiChainSampler)
        run = fast.chain

        def counted(*args, **kw):
            self.n += 1
            return run(*args, **kw)

        fast.chain = counted


def act(p, serving, o, **kw):
    p.cfg.fast_serving, before = serving, p.cfg.fast_serving
    try:
        return p.act(o, **kw)
    finally:
        p.cfg.fast_serving = before


def with_extras(o, chunk):
    return dict(o, **{f"extra.{k}": v for k, v in chunk.extras.items()})


def assert_same_chunk(fast, ref, atol=2e-5, rtol=1e-4, lp_atol=1e-4):
    assert set(fast.extras) == set(ref.extras)
    torch.testing.assert_close(fast.extras["noise"], ref.extras["noise"], rtol=0, atol=0)
    if "sde_step" in ref.extras:
        assert torch.equal(fast.extras["sde_step"], ref.extras["sde_step"])
    torch.testing.assert_close(fast.extras["chain"], ref.extras["chain"], atol=atol, rtol=rtol)
    torch.testing.assert_close(fast.actions, ref.actions, atol=atol, rtol=rtol)
    torch.testing.assert_close(fast.log_prob, ref.log_prob, atol=lp_atol, rtol=0)


@pytest.mark.parametrize("b", [1, 3])
@pytest.mark.parametrize("deterministic", [True, False], ids=["det", "stoch"])
@pytest.mark.parametrize("variant,mode", CASES)
def test_fast_chain_equals_the_eager_act(policies, variant, mode, deterministic, b):
    """The same x_0, step noise and k*: the fast chain and the eager act give the same actions,
    chain, log-prob and extras (float32 round-off); a deterministic act ignores the step noise
    and k* (the ODE from x_0 = 0, k* = 0)."""
    p = policies(variant, mode)
    calls = ChainCalls(p)
    o = obs(b)
    noise, eps, k_star = randomness(p, b)
    kw = dict(deterministic=deterministic, noise=None if deterministic else noise, step_noise=eps, sde_step=k_star)
    fast = act(p, "eager", o, **kw)
    assert calls.n == 1 and p._fast.captures == 0  # the fast sampler ran it, without graphs on a CPU
    ref = act(p, "off", o, **kw)
    assert calls.n == 1
    assert fast.actions.shape == (b, CHUNK, SPEC.action_dim) and fast.log_prob.shape == (b,)
    assert fast.extras["chain"].shape == (b, STEPS + 1, CHUNK, p.max_dim)
    assert_same_chunk(fast, ref)
    chain = ref.extras["chain"]
    assert (chain[:, 1:] - chain[:, :-1]).abs().amax() > 0.05  # the steps move: not a comparison of zeros
    if deterministic:
        assert torch.count_nonzero(chain[:, 0]) == 0
        if mode == "sde":
            assert torch.count_nonzero(ref.extras["sde_step"]) == 0
        return
    assert torch.equal(chain[:, 0], noise)
    if mode == "sde":
        assert torch.equal(fast.extras["sde_step"][:, 0], k_star)
    # the step noise is used: other step noise, another chain (Flow-SDE: at each row's own k*)
    other = act(p, "eager", o, **dict(kw, step_noise=eps.flip(1)))
    moved = (other.extras["chain"] - fast.extras["chain"]).abs().amax(dim=(2, 3))  # [B, K+1]
    first = torch.ones(b, dtype=torch.long) if mode == "noise" else k_star + 1  # x_first: the first sampled
    after = torch.arange(STEPS + 1)[None] >= first[:, None]
    assert (moved[after] > 1e-3).all() and (moved[~after] == 0).all()


@pytest.mark.parametrize("variant,mode", CASES)
def test_fast_act_log_prob_is_recomputed_from_its_extras(policies, variant, mode):
    """The update's ``log_prob`` from a fast act's extras equals the act's log-prob (eval, no
    gradients: float32 round-off; training mode with adapters unfolded: as tests/test_flow_rl.py
    bounds it); with the randomness drawn inside the act (the same torch seed) both paths give the
    same chunk; in training mode the act does not take the fast path."""
    p = policies(variant, mode)
    calls = ChainCalls(p)
    o = obs(3, seed=2)
    for deterministic in (True, False):  # the stochastic chunk last: training mode recomputes it below
        torch.manual_seed(7)
        c = act(p, "eager", o, deterministic=deterministic)
        torch.manual_seed(7)
        ref = act(p, "off", o, deterministic=deterministic)
        assert_same_chunk(c, ref)
        with torch.no_grad():
            torch.testing.assert_close(p.log_prob(with_extras(o, c), c.actions), c.log_prob, rtol=0, atol=1e-5)
    assert calls.n == 2
    p.train()
    try:
        lp = p.log_prob(with_extras(o, c), c.actions)
        torch.testing.assert_close(lp.detach(), c.log_prob, rtol=0, atol=1e-2)
        act(p, "eager", o)
        assert calls.n == 2  # training mode: the eager act
    finally:
        p.eval()
    with pytest.raises(ValueError, match="step_noise must be"):
        p.act(o, step_noise=torch.zeros(3, STEPS, CHUNK, 3))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("mode", ["noise", "sde"])
def test_chain_graphs_equal_eager_on_gpu_and_read_new_weights(ckpts, mode):
    """bf16 on a GPU: the chain's CUDA graphs (one per bucket and deterministic / stochastic)
    equal the same computation without graphs (tight) and the eager act through lerobot's modules
    (bf16 tolerance); a replay captures nothing new; new noise-head weights (the weight sync's
    ``flow_rl.noise.*``) reach the next replay without a capture; ``warm_up`` captures both acts."""
    p = build(ckpts["pi0"], "pi0", mode, device="cuda", dtype="bfloat16", fast_serving="graphs", fast_compile=False)
    o = obs(3, device="cuda")
    noise, eps, k_star = randomness(p, 3, device="cuda")

    def three(**kw):
        """(graphs, the fast path without graphs, lerobot's modules) on the same randomness."""
        graphs = act(p, "graphs", o, noise=noise, step_noise=eps, sde_step=k_star, **kw)
        sampler = p._fast
        p._fast = None
        try:
            eager = act(p, "eager", o, noise=noise, step_noise=eps, sde_step=k_star, **kw)
            assert p._fast.captures == 0
        finally:
            p._fast = sampler
        return graphs, eager, act(p, "off", o, noise=noise, step_noise=eps, sde_step=k_star, **kw)

    first = {}
    for det in (True, False):
        graphs, eager, ref = three(deterministic=det)
        assert_same_chunk(graphs, eager, atol=2e-3, rtol=2e-3, lp_atol=2e-2)
        assert_same_chunk(graphs, ref, atol=3e-2, rtol=3e-2, lp_atol=0.3)
        first[det] = graphs
    fast = p._fast
    assert fast.captures == 2 and sorted(k[0] for k in fast._graphs) == [4, 4]  # batch 3 -> bucket 4
    again = act(p, "graphs", o, noise=noise, step_noise=eps, sde_step=k_star)
    assert fast.captures == 2
    assert_same_chunk(again, first[False], atol=1e-6, rtol=0, lp_atol=1e-5)
    if mode == "noise":  # new noise-head weights through the weight sync: the next replay reads them
        state = p.trainable_state_dict()
        bias = [k for k in state if k.startswith("flow_rl.noise.") and k.endswith(".bias")][-1]  # the output layer's
        state[bias] = state[bias] + 1.0  # each log std up by about 0.45: each log-prob down by about 15
        p.load_trainable_state_dict(state)
        p.eval()
        graphs, eager, ref = three(deterministic=False)
        assert fast.captures == 2
        assert (graphs.log_prob < first[False].log_prob - 2.0).all(), (graphs.log_prob, first[False].log_prob)
        assert_same_chunk(graphs, eager, atol=2e-3, rtol=2e-3, lp_atol=2e-2)
        assert_same_chunk(graphs, ref, atol=3e-2, rtol=3e-2, lp_atol=0.3)
    # warm-up captures the deterministic and the stochastic graph of a bucket; acts then replay
    assert sorted(p.warm_up([1])) == [1] and fast.captures == 4
    one = {k: v[:1] for k, v in o.items()}
    for det in (True, False):
        act(p, "graphs", one, deterministic=det)
    assert fast.captures == 4
