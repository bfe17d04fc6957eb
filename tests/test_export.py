"""tools.export: a trained policy written in another stack's format, loaded back by that stack's
own loader, acts as Tandem did (same observations, same noise).

Every policy's trainable weights (LoRA adapters, heads) are perturbed first, and the test checks
that the untrained policy acts differently: an export that dropped the adapters or a head fails.

Loaders:
- PI0 / PI0.5: lerobot's ``PI0Policy`` / ``PI05Policy.from_pretrained`` and
  ``make_pre_post_processors(pretrained_path=...)``, the tokenizer step pointed at the exported
  ``tokenizer/`` (the hub's PaliGemma tokenizer is not reachable here). The tiny models build
  inside ``lerobot_sizes`` (lerobot's PaliGemma constructor hard-codes the 3B sizes; Tandem
  swaps its size table for that build, nothing else).
- OpenVLA-OFT: OFT's own code needs timm 0.9.x and its fork of transformers 4.40.1, which do
  not install beside lerobot, so the OFT side is assembled as close to it as runs here: the VLA
  through transformers' ``PreTrainedModel.from_pretrained`` (config.json, sharded safetensors +
  index, strict key check) into Tandem's key-compatible rebuild of OFT's network; the heads with
  OFT's ``find_checkpoint_file`` / ``load_component_state_dict`` into OFT's own head classes;
  OFT's proprio normalisation and action un-normalisation from ``dataset_statistics.json``
  (those functions and classes copied below from moojink/openvla-oft @ 213c5ff, MIT).
- MLP: ``safetensors.torch.load_file`` into an MLPPolicy built from the exported config.json.
"""

from __future__ import annotations

import contextlib
import io
import json
import os

import numpy as np
import pytest
import torch
from torch import nn

from agents.policies.mlp import MLPPolicy, MLPPolicyConfig
from data.core.spec import EnvSpec
from tools.export import ExportError, export_policy
from tools.export.__main__ import main as export_main

SPEC = EnvSpec(state_dim=8, action_dim=7, cameras={"image": (48, 48, 3), "wrist_image": (48, 48, 3)}, has_task=True)
OFT_SPEC = EnvSpec(state_dim=8, action_dim=7, cameras={"image": (56, 56, 3), "wrist_image": (56, 56, 3)}, has_task=True)
CHUNK = 8
TASKS = ["pick up the bowl", "Open the drawer", "stack the cups"]


def obs(spec, b=3, seed=0):
    """States inside the tiny checkpoints' q01..q99 (see test_pi0_and_pi05_export_to_lerobot)."""
    g = torch.Generator().manual_seed(seed)
    o = {"observation.state": torch.rand(b, spec.state_dim, generator=g) * 0.8 - 0.4, "task": TASKS[:b]}
    for cam, (h, w, _) in spec.cameras.items():
        o[f"observation.images.{cam}"] = torch.randint(0, 256, (b, h, w, 3), dtype=torch.uint8, generator=g)
    return o


def perturb(policy, seed=3, scale=0.05):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in policy.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=g).to(p.dtype) * scale)
    return policy


# -- PI0 / PI0.5 -> lerobot ---------------------------------------------------------------------
@pytest.mark.parametrize("variant", ["pi0", "pi05"])
def test_pi0_and_pi05_export_to_lerobot(variant, tmp_path):
    """lerobot loads the folder and acts as Tandem did. States are kept inside the statistics'
    q01..q99: PI0.5 discretises the normalised state into its prompt, and Tandem clamps it to
    [-1, 1] first while lerobot does not, so a state outside that range gives another prompt."""
    from lerobot.policies.factory import make_pre_post_processors
    from safetensors.torch import load_file

    from agents.policies.pi0.policy import Pi0Policy, Pi0PolicyConfig, Pi05Policy, Pi05PolicyConfig
    from agents.policies.pi0.lerobot_modules import lerobot_pi_module, lerobot_sizes
    from tools.make_tiny_checkpoints import make_pi0

    cls, cfg_cls = (Pi0Policy, Pi0PolicyConfig) if variant == "pi0" else (Pi05Policy, Pi05PolicyConfig)
    ckpt = make_pi0(tmp_path / "ckpt", SPEC, variant=variant, chunk_size=CHUNK)
    make = lambda: cls(cfg_cls(checkpoint=str(ckpt), chunk_size=CHUNK, lora_rank=4, clip_actions=False), SPEC)  # noqa: E731
    policy = perturb(make()).eval()
    out = tmp_path / "export"
    report = export_policy(policy, "lerobot", out, policy_name=variant)
    assert {"config.json", "model.safetensors", "policy_preprocessor.json", "policy_postprocessor.json",
            "tokenizer", "tandem_export.json"} <= set(report["files"])
    assert report["merged_lora_layers"] > 0
    exported, base = load_file(str(out / "model.safetensors")), load_file(str(ckpt / "model.safetensors"))
    assert not [k for k in exported if "lora_" in k or "base_layer" in k]
    w = "model.paligemma_with_expert.gemma_expert.model.layers.0.self_attn.q_proj.weight"
    assert (exported[w] - base[w]).abs().max() > 1e-3  # the adapter is in the weight

    o, g = obs(SPEC), torch.Generator().manual_seed(7)
    noise = torch.randn(3, CHUNK, int(policy.lr_cfg.max_action_dim), generator=g)
    want = policy.act(o, noise=noise).actions
    untrained = make().eval().act(o, noise=noise).actions
    assert (untrained - want).abs().max() > 1e-2  # the perturbation shows in the actions

    mod = lerobot_pi_module(variant)
    printed = io.StringIO()
    with lerobot_sizes(variant, policy.arch), contextlib.redirect_stdout(printed):
        lr = (mod.PI0Policy if variant == "pi0" else mod.PI05Policy).from_pretrained(str(out))
    assert "All keys loaded successfully!" in printed.getvalue(), printed.getvalue()  # it only prints failures
    pre, post = make_pre_post_processors(lr.config, pretrained_path=str(out), preprocessor_overrides={
        "tokenizer_processor": {"tokenizer_name": str(out / "tokenizer")}})
    batch = {"observation.state": o["observation.state"], "task": list(o["task"])}
    for cam in SPEC.cameras:  # lerobot's convention: float [B, 3, H, W] in [0, 1]
        batch[f"observation.images.{cam}"] = o[f"observation.images.{cam}"].permute(0, 3, 1, 2).float() / 255
    got = post(lr.predict_action_chunk(pre(batch), noise=noise))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)

    # the folder is also a Tandem checkpoint (the adapters merged: no LoRA needed)
    again = cls(cfg_cls(checkpoint=str(out), chunk_size=CHUNK, lora_rank=0, clip_actions=False), SPEC).eval()
    torch.testing.assert_close(again.act(o, noise=noise).actions, want, atol=1e-5, rtol=1e-5)


def test_pi0_from_an_sft_file_and_from_an_exported_folder_through_the_command_line(tmp_path):
    """--checkpoint as tools/sft.py writes it (the trainable state, with policy.checkpoint the base
    model), and an exported folder given back as --checkpoint (a policy checkpoint folder)."""
    from safetensors.torch import save_file

    from agents.policies.pi0.policy import Pi0Policy, Pi0PolicyConfig
    from agents.registry import build_policy
    from envs.registry import env_spec
    from tools.make_tiny_checkpoints import make_pi0
    from tools.sft import learner_config

    spec = env_spec(learner_config(["env=point_reach"]).env)  # a 32x32 camera, 2-D state and action
    ckpt = make_pi0(tmp_path / "ckpt", spec, chunk_size=4)
    common = ["env=point_reach", "policy=pi0", "policy.chunk_size=4", "+policy.clip_actions=false"]
    trained = perturb(build_policy(learner_config([*common, f"policy.checkpoint={ckpt}", "policy.lora_rank=4"]).policy, spec))
    save_file({k: v.contiguous() for k, v in trained.trainable_state_dict().items()}, str(tmp_path / "sft.safetensors"))
    first = export_main(["--checkpoint", str(tmp_path / "sft.safetensors"), "--format", "lerobot",
                         "--out", str(tmp_path / "a"), *common, f"policy.checkpoint={ckpt}", "policy.lora_rank=4"])
    assert first["source_kind"] == "trainable" and first["merged_lora_layers"] > 0
    again = export_main(["--checkpoint", str(tmp_path / "a"), "--format", "lerobot", "--out", str(tmp_path / "b"),
                         *common, "policy.lora_rank=0"])
    assert again["source_kind"] == "policy_checkpoint" and again["merged_lora_layers"] == 0
    o = obs(spec, b=2)
    noise = torch.randn(2, 4, int(trained.lr_cfg.max_action_dim), generator=torch.Generator().manual_seed(2))
    loaded = Pi0Policy(Pi0PolicyConfig(checkpoint=str(tmp_path / "b"), chunk_size=4, lora_rank=0, clip_actions=False), spec)
    torch.testing.assert_close(loaded.eval().act(o, noise=noise).actions, trained.eval().act(o, noise=noise).actions,
                               atol=1e-5, rtol=1e-5)


# -- OpenVLA-OFT ------------------------------------------------------------------------------------
# From moojink/openvla-oft @ 213c5ff (MIT): experiments/robot/openvla_utils.py (find_checkpoint_file,
# load_component_state_dict, normalize_proprio), prismatic/models/action_heads.py and projectors.py
# (the head classes), modeling_prismatic.py (_unnormalize_actions); BOUNDS_Q99, as for LIBERO.
def find_checkpoint_file(pretrained_checkpoint: str, file_pattern: str) -> str:
    assert os.path.isdir(pretrained_checkpoint), f"Checkpoint path must be a directory: {pretrained_checkpoint}"
    checkpoint_files = []
    for filename in os.listdir(pretrained_checkpoint):
        if file_pattern in filename and "checkpoint" in filename:
            checkpoint_files.append(os.path.join(pretrained_checkpoint, filename))
    assert len(checkpoint_files) == 1, (
        f"Expected exactly 1 {file_pattern} checkpoint but found {len(checkpoint_files)} in directory: {pretrained_checkpoint}")
    return checkpoint_files[0]


def load_component_state_dict(checkpoint_path: str) -> dict:
    state_dict = torch.load(checkpoint_path, weights_only=True)
    new_state_dict = {}
    for k, v in state_dict.items():
        if k.startswith("module."):
            new_state_dict[k[7:]] = v
        else:
            new_state_dict[k] = v
    return new_state_dict


def normalize_proprio(proprio: np.ndarray, norm_stats: dict) -> np.ndarray:
    mask = norm_stats.get("mask", np.ones_like(norm_stats["q01"], dtype=bool))
    proprio_high, proprio_low = np.array(norm_stats["q99"]), np.array(norm_stats["q01"])
    return np.clip(np.where(mask, 2 * (proprio - proprio_low) / (proprio_high - proprio_low + 1e-8) - 1, proprio),
                   a_min=-1.0, a_max=1.0)


def unnormalize_actions(normalized_actions: np.ndarray, action_norm_stats: dict) -> np.ndarray:
    mask = action_norm_stats.get("mask", np.ones_like(action_norm_stats["q01"], dtype=bool))
    action_high, action_low = np.array(action_norm_stats["q99"]), np.array(action_norm_stats["q01"])
    return np.where(mask, 0.5 * (normalized_actions + 1) * (action_high - action_low + 1e-8) + action_low,
                    normalized_actions)


class MLPResNetBlock(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.dim = dim
        self.ffn = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, dim), nn.ReLU())

    def forward(self, x):
        return self.ffn(x) + x


class MLPResNet(nn.Module):
    def __init__(self, num_blocks, input_dim, hidden_dim, output_dim):
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(input_dim)
        self.fc1 = nn.Linear(input_dim, hidden_dim)
        self.relu = nn.ReLU()
        self.mlp_resnet_blocks = nn.ModuleList([MLPResNetBlock(dim=hidden_dim) for _ in range(num_blocks)])
        self.layer_norm2 = nn.LayerNorm(hidden_dim)
        self.fc2 = nn.Linear(hidden_dim, output_dim)

    def forward(self, x):
        x = self.relu(self.fc1(self.layer_norm1(x)))
        for block in self.mlp_resnet_blocks:
            x = block(x)
        return self.fc2(self.layer_norm2(x))


class L1RegressionActionHead(nn.Module):
    def __init__(self, input_dim=4096, hidden_dim=4096, action_dim=7, num_actions_chunk=8):
        super().__init__()
        self.action_dim, self.num_actions_chunk = action_dim, num_actions_chunk  # OFT: module constants
        self.model = MLPResNet(num_blocks=2, input_dim=input_dim * action_dim, hidden_dim=hidden_dim,
                               output_dim=action_dim)

    def predict_action(self, actions_hidden_states):
        batch_size = actions_hidden_states.shape[0]
        return self.model(actions_hidden_states.reshape(batch_size, self.num_actions_chunk, -1))


class ProprioProjector(nn.Module):
    def __init__(self, llm_dim: int, proprio_dim: int) -> None:
        super().__init__()
        self.llm_dim, self.proprio_dim = llm_dim, proprio_dim
        self.fc1 = nn.Linear(self.proprio_dim, self.llm_dim, bias=True)
        self.fc2 = nn.Linear(self.llm_dim, self.llm_dim, bias=True)
        self.act_fn1 = nn.GELU()

    def forward(self, proprio):
        return self.fc2(self.act_fn1(self.fc1(proprio)))


def hf_openvla_class():
    """An ``OpenVLAForActionPrediction`` for transformers' ``from_pretrained``: OFT's module names
    (vision_backbone, projector, language_model), Tandem's rebuild of OFT's network inside."""
    from transformers import PretrainedConfig, PreTrainedModel

    from agents.policies.openvla_oft.prismatic import OpenVLA, PrismaticConfig

    class OpenVLAConfig(PretrainedConfig):
        model_type = "openvla"

    class OpenVLAForActionPrediction(PreTrainedModel):
        config_class = OpenVLAConfig

        def __init__(self, config):
            super().__init__(config)
            net = OpenVLA(PrismaticConfig.from_dict(config.to_dict()))
            self.vision_backbone, self.projector, self.language_model = net.vision_backbone, net.projector, net.language_model
            self.post_init()

        def _init_weights(self, module):
            pass  # every tensor comes from the checkpoint (a missing one is reported)

        action_hidden = OpenVLA.action_hidden

    return OpenVLAForActionPrediction


def oft_predict(out, o, key):
    """OFT's predict_action recipe, one observation at a time (OFT serves batch 1): returns the
    head's normalised chunks and the un-normalised actions, each [B, chunk, A]."""
    from transformers import AutoTokenizer

    vla, info = hf_openvla_class().from_pretrained(str(out), output_loading_info=True, dtype=torch.float32)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    vla.vision_backbone.num_images = 2  # OFT: vla.vision_backbone.set_num_images_in_input(2)
    d = vla.config.text_config["hidden_size"]
    head = L1RegressionActionHead(input_dim=d, hidden_dim=d, action_dim=7)
    head.load_state_dict(load_component_state_dict(find_checkpoint_file(str(out), "action_head")))
    proprio_projector = ProprioProjector(llm_dim=d, proprio_dim=8)
    proprio_projector.load_state_dict(load_component_state_dict(find_checkpoint_file(str(out), "proprio_projector")))
    stats = json.loads((out / "dataset_statistics.json").read_text())[key]
    pre = json.loads((out / "preprocessor_config.json").read_text())
    tok = AutoTokenizer.from_pretrained(str(out))
    space, stop = tok.convert_tokens_to_ids("▁"), tok.eos_token_id  # Llama-2's 29871 and 2 in OFT
    norm, acts = [], []
    for i, task in enumerate(o["task"]):
        ids = tok(f"In: What action should the robot take to {task.lower()}?\nOut:")["input_ids"]
        ids = ids + ([space] if ids[-1] != space else [])
        k = 7 * CHUNK
        input_ids = torch.tensor([ids + [1] * k + [stop]])  # placeholders, then the stop token
        action_mask = torch.tensor([[False] * len(ids) + [True] * k + [False]])
        pix = []
        for cam in ("image", "wrist_image"):  # the primary image, then the wrist image
            img = o[f"observation.images.{cam}"][i].permute(2, 0, 1).float()[None] / 255
            pix += [(img - torch.tensor(m).view(1, 3, 1, 1)) / torch.tensor(s).view(1, 3, 1, 1)
                    for m, s in zip(pre["means"], pre["stds"])]
        proprio = normalize_proprio(o["observation.state"][i].numpy(), stats["proprio"])
        with torch.no_grad():
            emb = proprio_projector(torch.tensor(proprio, dtype=torch.float32)[None])
            hidden = vla.action_hidden(torch.cat(pix, 1), input_ids, torch.ones_like(action_mask), action_mask, emb)
            n = head.predict_action(hidden)[0].numpy()
        norm.append(n)
        acts.append(unnormalize_actions(n, stats["action"]))
    return torch.tensor(np.stack(norm)), torch.tensor(np.stack(acts), dtype=torch.float32)


def test_openvla_oft_exports_to_oft_layout(tmp_path):
    """OFT's layout, loaded the OFT way (see the module docstring), gives Tandem's actions: the
    head's normalised chunk exactly, the actions once Tandem's clamps are applied (Tandem clamps
    the normalised chunk and the action to [-1, 1], OFT's predict_action does neither)."""
    from agents.policies.openvla_oft.policy import OpenVLAOFTPolicy, OpenVLAOFTPolicyConfig
    from tools.make_tiny_checkpoints import make_openvla_oft

    ckpt = make_openvla_oft(tmp_path / "ckpt", OFT_SPEC)
    make = lambda: OpenVLAOFTPolicy(OpenVLAOFTPolicyConfig(checkpoint=str(ckpt), lora_rank=4), OFT_SPEC)  # noqa: E731
    policy = perturb(make()).eval()
    out = tmp_path / "export"
    report = export_policy(policy, "openvla_oft", out, policy_name="openvla_oft", max_shard_size="300KB")
    files = set(report["files"])
    assert len([f for f in files if f.startswith("model-0")]) > 1  # sharded, as save_pretrained shards a 7B
    assert {"config.json", "model.safetensors.index.json", "action_head--0_checkpoint.pt", "proprio_projector--0_checkpoint.pt", "dataset_statistics.json",
            "preprocessor_config.json", "tokenizer.json"} <= files
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "openvla" and cfg["auto_map"]["AutoModelForVision2Seq"].endswith("OpenVLAForActionPrediction")
    from agents.policies.openvla_oft.policy import read_weights

    w = "language_model.model.layers.0.self_attn.q_proj.weight"
    assert (read_weights(out)[w] - read_weights(ckpt)[w]).abs().max() > 1e-3  # the adapter is in the weight
    key = report["unnorm_key"]
    assert key == "tiny_dataset" and list(cfg["norm_stats"]) == [key]

    o = obs(OFT_SPEC)
    inputs = policy.model_inputs(o)
    want_norm = policy.forward_model(inputs).float()
    want = policy.act(o).actions
    assert (make().eval().act(o).actions - want).abs().max() > 1e-2  # the perturbation shows
    norm, acts = oft_predict(out, o, key)
    torch.testing.assert_close(norm, want_norm, atol=1e-5, rtol=1e-5)
    clamped = torch.tensor(unnormalize_actions(norm.clamp(-1, 1).numpy(), json.loads(
        (out / "dataset_statistics.json").read_text())[key]["action"]), dtype=torch.float32).clamp(-1, 1)
    torch.testing.assert_close(clamped, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(acts[norm.abs() <= 1], clamped[norm.abs() <= 1], atol=1e-5, rtol=1e-5)


# -- MLP, through the command line, from a learner checkpoint ----------------------------------------
def sac_run(run_dir, overrides):
    """A learner checkpoint of SAC + MLP as the learner writes it; returns the trained policy."""
    from agents import registry
    from envs.registry import env_spec
    from learner.app import make_accelerator
    from learner.checkpoint import save_checkpoint
    from tools.sft import learner_config

    cfg = learner_config([*overrides, "algo=sac", "buffer.persist=false", f"run_dir={run_dir}"])
    spec = env_spec(cfg.env)
    builder = registry.build_builder(cfg.algo)
    policy = registry.build_trained_policy(builder, cfg.policy, spec)
    spec = spec.with_extras(policy.extras_spec())
    data = builder.make_data(spec, cfg.buffer, run_dir=run_dir, seed=0, device="cpu", train=True)
    algo = builder.make_learner(builder.make_networks(spec, policy, torch.device("cpu")), data,
                                make_accelerator(True, 60), env_steps=lambda: 0)
    perturb(policy, scale=0.3)
    save_checkpoint(run_dir / "checkpoints", 1234, {"algo": algo.state_dict(), "ingest": {}, "version": 5})
    return policy


def test_mlp_export_from_a_run_through_the_command_line(tmp_path):
    overrides = ["env=inverted_pendulum", "policy=mlp"]
    trained = sac_run(tmp_path / "run", overrides).eval()
    out = tmp_path / "export"
    report = export_main(["--checkpoint", str(tmp_path / "run"), "--format", "mlp", "--out", str(out), *overrides])
    assert report["step"] == 1234 and report["source"].endswith("step_0000001234")
    cfg = json.loads((out / "config.json").read_text())
    from safetensors.torch import load_file

    net = MLPPolicy(MLPPolicyConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in cfg["policy"].items()}),
                    EnvSpec(**cfg["spec"]))
    net.load_state_dict(load_file(str(out / "model.safetensors")))
    net.eval()
    o = {"observation.state": torch.randn(16, cfg["spec"]["state_dim"], generator=torch.Generator().manual_seed(0))}
    torch.testing.assert_close(net.act(o, deterministic=True).actions, trained.act(o, deterministic=True).actions)
    torch.manual_seed(1)
    got = net.act(o).actions
    torch.manual_seed(1)
    torch.testing.assert_close(got, trained.act(o).actions)
    fresh = MLPPolicy(MLPPolicyConfig(hidden_dims=(64, 64)), EnvSpec(**cfg["spec"])).eval()
    assert (fresh.act(o, deterministic=True).actions - got).abs().max() > 1e-2


def test_bad_input_gives_clear_errors(tmp_path):
    overrides = ["env=inverted_pendulum", "policy=mlp"]
    run = tmp_path / "run"
    sac_run(run, overrides)
    args = lambda ckpt, fmt, out, *more: ["--checkpoint", str(ckpt), "--format", fmt, "--out", str(out), *more]  # noqa: E731
    with pytest.raises(ExportError, match="does not exist"):
        export_main(args(tmp_path / "nope", "mlp", tmp_path / "o1", *overrides))
    with pytest.raises(ExportError, match=r"unknown --format 'onnx'; choose one of \['lerobot', 'mlp', 'openvla_oft'\]"):
        export_main(args(run, "onnx", tmp_path / "o2", *overrides))
    with pytest.raises(ExportError, match="--format lerobot exports Pi0Policy policies, not MLPPolicy; "
                                          "policy=mlp exports with --format mlp"):
        export_main(args(run, "lerobot", tmp_path / "o3", *overrides))
    with pytest.raises(ExportError, match=r"(?s)does not fit the policy built from the overrides.*size mismatch for trunk"):
        export_main(args(run, "mlp", tmp_path / "o4", *overrides, "policy.hidden_dims=[32,32]"))
    with pytest.raises(ExportError, match="neither a run directory"):
        export_main(args(tmp_path / "o4", "mlp", tmp_path / "o5", *overrides))
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "x").write_text("x")
    with pytest.raises(ExportError, match="is not empty; pass --overwrite"):
        export_main(args(run, "mlp", tmp_path / "used", *overrides))
