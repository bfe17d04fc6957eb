"""The fast serving path of OpenVLA-OFT (:mod:`agents.policies.openvla_oft.policy`, both heads): the
same modules and weights, one CUDA graph per served batch size.

Why: one OFT act is a single parallel-decoding forward of Llama-2-7B over ~600 tokens plus two
ViTs (a few TFLOP, a few ms of GPU arithmetic); eager PyTorch spends most of a batch-1 call
launching ~3000 kernels from Python, and the eager path syncs with the host (``int(mask.sum())``,
boolean indexing of the action positions).

What this does instead, with the policy's own modules (timm ViTs, projector, transformers'
Llama decoder layers, heads), so loaded checkpoints and LoRA folding apply unchanged:

- the decoder layers run in a plain loop with a device-built additive key-padding mask (SDPA,
  the model's dtype) and positions ``0..T-1`` (as transformers builds them), no mask helper;
- the K action positions are gathered from an index computed on the device (no host sync);
- the head runs inside the call: L1 -> un-normalised, clipped actions; discrete -> tempered
  logits, tokens ``argmax(logits + gumbel)`` (Gumbel-max: a sample from the softmax; zeros
  give the greedy tokens), their log-probability, the actions;
- the token rows are right-padded to a length bucket (``token_multiple``) so that a few graphs
  serve every prompt; padded keys are masked, positions of real tokens do not move, so a row's
  result does not depend on its padding;
- on a GPU, the whole call is captured once per (batch bucket, token length, adapter fold
  state) into a CUDA graph over static input buffers, after two warm-up runs; a request is
  padded to the next bucket (rows repeated) and sliced back. Replays read the parameters in
  place, so new weights and re-folded adapters (``LoRAServing`` copies into the same tensors)
  need no recapture; a change of the fold state (different modules) captures anew. The
  Gumbel noise is an input buffer filled before each replay (a fresh draw per call).

With ``policy.fast_compile`` (``auto``: on a GPU) the LM layer stack runs through
``torch.compile`` inside the graphs, the batch (>= 2) and the token length symbolic
(:mod:`agents.policies.fast_common`): one compile for batch 1 and one for every other bucket and
prompt length. What each path costs: docs/benchmarks.md, "VLA serving". With ``policy.fast_aot_dir`` the
compiled stack is compiled ahead of time instead (:mod:`agents.policies.fast_aot`), one function
per batch-1-or-more, fold state and FP8 setting, saved in that folder and loaded by later starts
without tracing (ship the folder with the checkpoint).
``OpenVLAOFTPolicy.warm_up`` compiles and captures ``fast_warmup_buckets`` before serving.

With ``policy.fast_llm_fp8`` (off by default) each decoder layer's seven linear layers (q/k/v/o,
gate, up, down) run in FP8 e4m3 inside the call (:mod:`agents.policies.fp8`: per-channel weight
scales, per-row activation scales, ``torch._scaled_mm``), re-quantized in place when the weights
change (a fold, new adapters): at a served batch of 8 the act is bound by these GEMMs'
arithmetic, which FP8 runs at up to twice bf16's rate on Hopper. The actions then differ from the
bf16 path's by the quantization; the trained copy stays bf16.

The result equals the policy's eager ``act`` on the same inputs: to float32 round-off on a CPU
(tests/test_oft_fast.py), within bf16 tolerance on a GPU (the GPU tests there).
"""

from __future__ import annotations

import logging
import time

import torch
import torch.nn.functional as F

from agents.base import ActionChunk, Batch
from agents.policies import fast_common
from agents.policies.fast_common import (compile_mode, compiled_graphs, gpu_kernels, mark_dynamic, prepare_compile,
                                         prompt_width_tasks, resolve_compile, static_shapes_only)
from agents.policies.fast_aot import AotFunctions
from agents.policies.fp8 import Fp8Layers, resolve_fp8
from agents.policies.stand_ins import nested

log = logging.getLogger("tandem.policies.oft_fast")

#: served batch sizes a graph is captured for (a request pads up to the next one)
DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
MODES = ("auto", "graphs", "eager", "off")
_IN = ("pix", "ids", "valid", "amask", "state", "gumbel")
#: SDPA backends in priority order for the decoder layers (the bench's --sdpa replaces it)
SDPA_ORDER = fast_common.SDPA_ORDER


def fast_path(policy) -> "FastOFT | None":
    """The policy's fast path for this call, or None (use the eager path): ``fast_serving``
    "off", training mode, gradients on, adapters switched off (a reference pass), or "auto"
    on a CPU. Built once and kept as ``policy._fast``."""
    mode = getattr(policy.cfg, "fast_serving", "off")
    if mode == "off" or policy.training or torch.is_grad_enabled() or policy.lora.pinned:
        return None
    cuda = policy.device.type == "cuda"
    if mode == "auto" and not cuda:
        return None
    fast = policy.__dict__.get("_fast")
    if fast is None:
        graphs = cuda and mode in ("auto", "graphs")
        fast = FastOFT(policy, graphs=graphs, compile=resolve_compile(getattr(policy.cfg, "fast_compile", False), graphs))
        policy.__dict__["_fast"] = fast  # not a submodule: no state_dict entry
    return fast


def warm_up_tasks(policy) -> list[str]:
    """The tasks ``policy``'s warm-up acts with: one per token-row width a prompt of up to
    ``fast_warmup_prompt_tokens`` tokens pads to (the default task's alone when that is 0 or the
    fast path is off)."""
    base = policy.cfg.default_task or "warm up"
    limit = int(policy.cfg.fast_warmup_prompt_tokens)
    fast = fast_path(policy)
    if limit <= 0 or fast is None:
        return [base]
    proprio = policy.proprio_projector is not None

    def columns(task: str) -> int:
        return fast.ids_width(int(policy._token_rows([task])[0].shape[1]), proprio)  # noqa: SLF001

    return prompt_width_tasks(columns, fast.ids_width(limit + policy.k + 1, proprio), base=base)


class FastOFT:
    """``act(obs)`` / ``forward(inputs)`` of an :class:`OpenVLAOFTPolicy` (either head).
    ``graphs``: capture CUDA graphs (on a CUDA device only); without, the same computation
    runs eagerly."""

    def __init__(self, policy, *, graphs: bool = True, buckets: tuple[int, ...] = DEFAULT_BUCKETS,
                 compile: bool | str | None = False, token_multiple: int = 32):
        self.p = policy
        self.discrete = policy.action_head is None
        self.buckets = tuple(sorted(int(b) for b in buckets))
        self.graphs = bool(graphs)
        self.token_multiple = int(token_multiple)
        self._graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, dict, dict]] = {}
        self._pool = None
        self._zeros: dict[tuple, torch.Tensor] = {}
        self.captures = 0  # graphs captured so far (tests and the bench read it)
        self.compiles = 0  # graphs dynamo compiled during those captures
        self.capture_s = 0.0  # seconds spent warming up and capturing
        # the LM layer stack through torch.compile (norms, rotary, SiLU, residuals fused):
        # "dynamic" with the batch (>= 2) and token length symbolic, "static" one per shape
        self.compile = mode = compile_mode(compile, "FastOFT")
        self._layers_fn = decoder_stack
        self.aot = None  # the layer stack compiled ahead of time (policy.fast_aot_dir), or None
        #: the Llama layers' FP8 stand-ins (policy.fast_llm_fp8), or None
        fp8 = resolve_fp8(getattr(policy.cfg, "fast_llm_fp8", False), "policy.fast_llm_fp8")
        lm = policy.model.language_model.model
        self.fp8 = (Fp8Layers(lm.layers[: lm.config.num_hidden_layers], fp8, what="OFT fast path FP8 language model",
                              setting="policy.fast_llm_fp8") if fp8 else None)
        if mode:
            prepare_compile()
            self._layers_fn = torch.compile(decoder_stack, dynamic=None if mode == "dynamic" else False)
            aot_dir = getattr(policy.cfg, "fast_aot_dir", None)
            if aot_dir:
                self.aot = AotFunctions(decoder_stack, aot_dir, "oft", lm.config.to_json_string(),
                                        dynamic=mode == "dynamic")

    # -- the computation (eager; captured as is) ---------------------------------------------------
    def compute(self, pix, ids, valid, amask, state, gumbel) -> dict[str, torch.Tensor]:
        """The whole call on device tensors (no host sync, no tensor-dependent branch):
        ``pix`` [B, 6n, S, S], ``ids``/``valid``/``amask`` [B, L], ``state`` [B, S] normalised
        or None, ``gumbel`` [B, K, 256] (discrete head; None for L1)."""
        p, m = self.p, self.p.model
        lm = m.language_model.model
        dtype = lm.embed_tokens.weight.dtype
        emb = lm.embed_tokens(ids) * (~amask)[..., None].to(dtype)
        patches = m.projector(m.vision_backbone(pix.to(m.projector.fc1.weight.dtype)))
        if state is not None:
            pp = p.proprio_projector
            patches = torch.cat([patches, pp(state.to(pp.fc1.weight.dtype))[:, None].to(patches.dtype)], dim=1)
        b, n = patches.shape[:2]
        x = torch.cat([emb[:, :1], patches.to(dtype), emb[:, 1:]], dim=1)
        t = x.shape[1]
        keep = torch.cat([valid[:, :1], valid.new_ones(b, n), valid[:, 1:]], dim=1).bool()
        zero = torch.zeros((), dtype=dtype, device=x.device)
        neg = torch.full((), torch.finfo(dtype).min, dtype=dtype, device=x.device)
        mask = torch.where(keep[:, None, None, :], zero, neg).expand(b, 1, t, t)
        pos = torch.arange(t, device=x.device)[None]
        if self.compile == "dynamic":
            mark_dynamic((0, 1), x, pos)
            mark_dynamic((0, 2, 3), mask)
        with nested(self.fp8.swapped() if self.fp8 is not None else None):
            if self.aot is not None:  # what the graph depends on beyond the dynamic sizes
                key = (b == 1, p.lora.folded, None if self.fp8 is None else self.fp8.mode, str(x.dtype))
                h = self.aot(key, lm, x, mask, pos)
            else:
                h = self._layers_fn(lm, x, mask, pos)
        # the K action positions: the first True of amask (ids coordinates) + n patch tokens
        start = amask.to(torch.int32).argmax(dim=1) + n
        idx = start[:, None] + torch.arange(p.k, device=x.device)[None]
        hk = h.gather(1, idx[..., None].expand(b, p.k, h.shape[-1]))
        if not self.discrete:
            head = p.action_head
            a_norm = head.predict_action(hk.to(head.model.fc1.weight.dtype))
            return {"a_norm": a_norm, "actions": p._finish(a_norm)}
        logits = p.action_logits(hk)  # float32, tempered
        cls = (logits + gumbel).argmax(-1)
        logp = logits.log_softmax(-1).gather(-1, cls[..., None]).squeeze(-1).sum(-1)
        a = p.class_values[cls].view(b, p.chunk_size, p.action_dim)
        return {"logits": logits, "cls": cls, "logp": logp, "actions": p._finish(a)}

    # -- serving -----------------------------------------------------------------------------------
    def bucket(self, b: int) -> int | None:
        """The captured batch size a request of ``b`` rows is padded to (None: beyond them)."""
        return next((s for s in self.buckets if s >= b), None)

    def _prepare(self, inputs: tuple, gumbel: torch.Tensor | None) -> dict:
        """The model inputs as a dict, token rows right-padded to the length bucket."""
        pix, ids, valid, amask, st = inputs
        extra = self.ids_width(ids.shape[1], st is not None) - ids.shape[1]
        if extra:
            ids = F.pad(ids, (0, extra), value=int(self.p.pad_id))
            valid, amask = F.pad(valid, (0, extra), value=False), F.pad(amask, (0, extra), value=False)
        if self.discrete and gumbel is None:
            gumbel = self._zero_gumbel(ids.shape[0], pix.device)
        return {"pix": pix, "ids": ids, "valid": valid, "amask": amask, "state": st,
                "gumbel": gumbel if self.discrete else None}

    def ids_width(self, n_ids: int, proprio: bool) -> int:
        """The token columns ``n_ids`` ids are right-padded to: ids + patches (+ the proprio
        token) a multiple of ``token_multiple`` (the graphs are keyed by it)."""
        n, mult = self._extra_tokens(proprio), self.token_multiple
        length = -(-(n_ids + n) // mult) * mult - n
        return length + mult if length < n_ids else length

    def _extra_tokens(self, proprio: bool) -> int:
        vb = self.p.model.vision_backbone
        return vb.num_images * vb.num_patches + int(proprio)

    def _zero_gumbel(self, b: int, device) -> torch.Tensor:
        key = (b, str(device))
        if key not in self._zeros:
            self._zeros[key] = torch.zeros(b, self.p.k, int(self.p.pcfg.n_action_bins), device=device)
        return self._zeros[key]

    def _serving_weights(self) -> None:
        if self.p.cfg.fold_lora_for_serving:
            self.p.lora.fold()
        else:
            self.p.lora.unfold()

    @torch.no_grad()
    def run(self, inputs: tuple, gumbel: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """The head's outputs (:meth:`compute`) for prepared inputs (``policy.model_inputs``);
        ``gumbel`` None: the greedy tokens (discrete head)."""
        self._serving_weights()
        if self.fp8 is not None:  # re-quantize what a fold or new weights changed (in place)
            self.fp8.sync()
        x = self._prepare(inputs, gumbel)
        b = x["ids"].shape[0]
        cuda = x["ids"].is_cuda
        bucket = self.bucket(b)
        if not (self.graphs and cuda) or bucket is None:
            with _kernels(cuda):
                return self.compute(*(x[k] for k in _IN))
        gkey = (bucket, self.p.lora.folded, _signature(x))
        if gkey not in self._graphs:
            try:
                with torch.inference_mode(False), torch.no_grad():  # normal tensors for the buffers
                    self._graphs[gkey] = self._capture(_pad(x, bucket))
            except Exception as exc:  # noqa: BLE001 - serve eagerly rather than fail the call
                log.warning("OFT fast path: CUDA graph capture failed for batch %d (%s: %s); serving eagerly "
                            "from now on", bucket, type(exc).__name__, exc)
                self.graphs = False
                self._graphs.clear()
                with _kernels(cuda):
                    return self.compute(*(x[k] for k in _IN))
        graph, static, out = self._graphs[gkey]
        for k, v in x.items():
            if v is not None:
                static[k][:b].copy_(v, non_blocking=True)
        graph.replay()
        return {k: v[:b].clone() for k, v in out.items()}

    def _capture(self, static: dict):
        t0, graphs0 = time.perf_counter(), compiled_graphs()
        # tensors the head caches lazily (action bounds) are made before the capture
        self.p._bounds("action", static["ids"].device)

        def run():
            with _kernels(True), static_shapes_only():
                return self.compute(*(static[k] for k in _IN))

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # warm-up: lazy inits, cuBLAS workspaces, autotuning, compile
                run()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        # thread_local: the learner's other threads may use CUDA meanwhile (a training step)
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            out = run()
        self.captures += 1
        self.capture_s += time.perf_counter() - t0
        new = compiled_graphs() - graphs0
        self.compiles += new
        log.info("OFT fast path: captured a CUDA graph for batch %d, %d tokens (%.1f s)%s",
                 static["ids"].shape[0], static["ids"].shape[1], time.perf_counter() - t0,
                 f", {new} graph(s) compiled ({self.compile})" if self.compile else "")
        return graph, static, out

    def forward(self, inputs: tuple) -> torch.Tensor:
        """``policy.forward_model``'s result: L1 -> normalised actions [B, chunk, A]; discrete
        -> tempered logits [B, K, 256]."""
        out = self.run(inputs)
        return out["logits"] if self.discrete else out["a_norm"]

    def act(self, obs: Batch, *, deterministic: bool = False, generator: torch.Generator | None = None) -> ActionChunk:
        """``policy.act``: actions [B, chunk, A] float32; discrete head: the chunk's log-prob and
        ``extras["action_tokens"]`` (sampled at the temperature, greedy when deterministic)."""
        inputs = self.p.model_inputs(obs)
        gumbel = None
        if self.discrete and not deterministic:
            b, dev = inputs[1].shape[0], inputs[1].device
            e = torch.empty(b, self.p.k, int(self.p.pcfg.n_action_bins), device=dev).exponential_(generator=generator)
            gumbel = -e.log()  # Gumbel(0, 1): argmax(logits + g) samples softmax(logits)
        out = self.run(inputs, gumbel)
        if not self.discrete:
            return ActionChunk(out["actions"])
        return ActionChunk(out["actions"], out["logp"], {"action_tokens": out["cls"]})


def decoder_stack(lm, x: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """The language model's decoder layers and final norm over embeddings ``x`` [B, T, D] with an
    additive ``mask`` [B, 1, T, T] and positions ``pos`` [1, T] (``lm``: the Llama model; it is an
    argument so that an ahead-of-time compiled stack reads the weights of the model it is given)."""
    pe = lm.rotary_emb(x, pos)
    for layer in lm.layers[: lm.config.num_hidden_layers]:
        x = layer(x, attention_mask=mask, position_ids=pos, position_embeddings=pe)
    return lm.norm(x)


def _kernels(cuda: bool):
    """TF32 for the float32 heads and SDPA's backends in ``SDPA_ORDER``."""
    return gpu_kernels(cuda, SDPA_ORDER)


def _signature(x: dict) -> tuple:
    """Shapes and dtypes past the batch dimension (a graph serves one signature)."""
    return tuple(None if x[k] is None else (tuple(x[k].shape[1:]), x[k].dtype) for k in _IN)


def _pad(x: dict, n: int) -> dict:
    """Static buffers of batch ``n``: the inputs, rows repeated to fill (cloned, owned here)."""
    def grow(t):
        if t is None:
            return None
        return t[torch.arange(n, device=t.device) % t.shape[0]].clone()

    return {k: grow(v) for k, v in x.items()}
