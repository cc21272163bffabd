"""configs/8b.py and configs/scout.py: the paper's settings (PAPER_NOTES §4) and a valid learner
layout for every named topology (mesh sizes, divisibility of every sharded dimension)."""
import importlib
import json
import math

import pytest

from scalerl_jax.models import sections as model_sections
from scalerl_jax import models, recipes, topologies

CONFIGS = ("8b", "scout")
PRESET = {"8b": "llama3_8b", "scout": "llama4_scout_17b_16e"}
REQUIRED = {"8b": {"h100_16", "tpu_v5p_16", "tpu_v5p_64", "gb200_16"},
            "scout": {"gb200_16", "gb200_32", "tpu_v5p_64", "h100_64", "tpu_v5p_16", "h100_16"}}


def _get(name, arg=None):
  return importlib.import_module(f"configs.{name}").get_config(arg)


@pytest.mark.parametrize("name", CONFIGS)
def test_paper_settings(name):
  c = _get(name)
  assert c.model.preset == PRESET[name]
  assert (c.model.param_dtype, c.model.dtype, c.model.fp32_lm_head) == ("float32", "bfloat16", True)
  assert c.model.hf_checkpoint == ""                       # --config.model.hf_checkpoint=/ckpt
  r = c.rollout
  assert (r.prompts_per_step, r.generations_per_prompt) == (48, 16)
  assert (r.think_budget_min, r.think_budget_max, r.answer_budget) == (10240, 12288, 2048)
  assert r.max_prompt_len == 2048 and r.mode == "pipeline" and r.max_lag == 8
  assert "time is up" in r.interruption_text and r.interruption_text.endswith("</think>")
  o = c.optim
  assert (o.lr, o.eps, o.weight_decay, o.warmup_steps) == (5e-7, 1e-15, 0.01, 100)
  assert (o.b1, o.b2) == (0.9, 0.999)
  assert (c.rl.loss, c.rl.cispo_eps_max, c.rl.aggregation, c.rl.adv_norm) == ("cispo", 5.0,
                                                                              "prompt", "batch")
  assert c.rl.zero_variance_filter and c.rl.no_positive_resampling and c.rl.npr_threshold == 0.9
  assert c.rl.length_control == "interrupt"
  recipes.validate(c)                                      # the run's own fail-fast checks pass


@pytest.mark.parametrize("name", CONFIGS)
def test_every_layout_divides(name):
  c = _get(name)
  cfg = model_sections.model_config(c)
  assert REQUIRED[name] <= set(c.layouts)
  for topo in c.layouts:
    c = _get(name, topo)
    t = topologies.get_topology(c.topology)   # a layout may name its topology (h100_16_fsdp)
    mesh = dict(c.mesh.shape)
    assert c.layout == topo and c.topology == c.layouts[topo].topology
    assert math.prod(mesh.values()) == t.num_devices
    batch = c.rollout.prompts_per_step * c.rollout.generations_per_prompt
    m = c.optim.microbatches
    assert batch == 768 and batch % m == 0
    # one 16k-token sequence per batch shard per micro-batch: rows over data x fsdp x expert (8B),
    # or rows over data and the sequence over fsdp x expert (Scout, sequence-parallel rules)
    rules = dict(c.mesh.rules)
    if c.layouts[topo].sequence_parallel:
      assert (rules["batch"], rules["seq"]) == ("data", ("fsdp", "expert"))
      assert batch // m == mesh["data"]
    else:
      assert (rules["batch"], rules["seq"]) == (("data", "fsdp", "expert"), None)
      assert batch // m == mesh["data"] * mesh["fsdp"] * mesh["expert"], (topo, m, mesh)
    assert batch // m == topologies.batch_split(c)
    tp, ep = mesh["tensor"], mesh["expert"]
    for dim in (cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size, cfg.ffn_dim):
      assert dim % tp == 0, (topo, dim, tp)
    assert cfg.d_model % (mesh["fsdp"] * mesh["expert"]) == 0
    if cfg.num_experts:
      assert cfg.num_experts % ep == 0 and cfg.expert_ffn_dim % tp == 0
    # remat: the memory plan's choice per layout (tools.plan --choose_remat; configs/8b.py), which
  # launch.preflight checks against the plan cache for the rendered variants
  assert c.model.remat in ("none", "dots", "full") and c.model.scan_layers


def test_topology_selection_and_errors():
  c = _get("8b", "tpu_v5p_64")
  assert dict(c.mesh.shape) == dict(data=1, fsdp=16, tensor=4, expert=1)
  assert c.optim.microbatches == 48
  c.topology = "h100_16"                                   # --config.topology=h100_16
  topologies.apply_layout(c)
  assert dict(c.mesh.shape)["tensor"] == 8 and c.optim.microbatches == 384
  assert _get("8b").topology == "h100_16" and _get("scout").topology == "gb200_32"
  c = _get("8b", "h100_16_fsdp")                           # a named layout on h100_16
  assert (c.topology, c.layout) == ("h100_16", "h100_16_fsdp")
  assert dict(c.mesh.shape) == dict(data=1, fsdp=16, tensor=1, expert=1)
  assert c.optim.microbatches == 48
  s = _get("scout", "gb200_16")                            # sequence-parallel rules follow
  assert dict(s.mesh.rules)["seq"] == ("fsdp", "expert") and s.optim.microbatches == 768
  s.layouts.gb200_16.sequence_parallel = False
  topologies.apply_layout(s)
  assert dict(s.mesh.rules)["seq"] is None
  assert dict(s.mesh.rules)["batch"] == ("data", "fsdp", "expert")
  with pytest.raises(ValueError, match="no layout for topology 'tpu_v9'"):
    _get("8b", "tpu_v9")
  with pytest.raises(ValueError, match="uses 8 devices, topology has 16"):
    topologies.check_layout("h100_16", dict(mesh=(("fsdp", 8),)))
  with pytest.raises(ValueError, match="unknown topology"):
    topologies.get_topology("v100_8")


def test_topology_memory_figures():
  t = topologies.TOPOLOGIES
  assert t["h100_16"].hbm_bytes == 80e9 and t["gb200_16"].hbm_bytes == 186e9
  assert t["tpu_v5p_16"].hbm_bytes == t["tpu_v5p_64"].hbm_bytes == 95e9
  assert [t[k].num_devices for k in ("tpu_v5p_16", "tpu_v5p_64", "h100_16", "gb200_16")] == \
      [16, 64, 16, 16]
  assert t["h100_16"].usable_bytes == 72e9


def test_hf_checkpoint_sets_architecture(tmp_path):
  """--config.model.hf_checkpoint=DIR: the architecture comes from DIR/config.json (runtime)."""
  transformers = pytest.importorskip("transformers")
  del transformers
  small = models.get_preset("tiny_llama3", num_layers=3, vocab_size=100)
  hf = models.to_hf_config(small)
  (tmp_path / "config.json").write_text(json.dumps(hf.to_dict()))
  c = _get("8b")
  c.model.hf_checkpoint = str(tmp_path)
  cfg = model_sections.model_config(c)
  assert (cfg.num_layers, cfg.vocab_size, cfg.d_model) == (3, 100, small.d_model)
  assert (cfg.param_dtype, cfg.dtype, cfg.remat, cfg.scan_layers) == ("float32", "bfloat16",
                                                                      c.model.remat, True)


def test_8b_math_code_is_the_paper_math_code_run():
  """configs/8b_math_code.py: configs/8b.py's settings on Polaris + DeepCoder, half the prompts each,
  1,000 held-out prompts per task, and the same learner layouts."""
  c, base = _get("8b_math_code"), _get("8b")
  assert c.data.mixture == "math:0.5,code:0.5"
  assert (c.data.tasks.math.kind, c.data.tasks.code.kind) == ("polaris", "deepcoder")
  assert c.data.tasks.math.heldout == c.data.tasks.code.heldout == 1000
  assert c.data.tasks.math.path == c.data.tasks.code.path == ""    # --config.data.tasks.X.path=
  for section in ("model", "rl", "optim", "rollout", "mesh"):
    assert c[section].to_dict() == base[section].to_dict(), section
  assert set(c.layouts) == set(base.layouts) and c.rewards.code_sandbox == "bwrap"
  assert dict(_get("8b_math_code", "tpu_v5p_64").mesh.shape)["fsdp"] == 16
  recipes.validate(c)


def test_tiny_multitask_config():
  c, tiny = _get("tiny_multitask"), _get("tiny")
  assert c.data.mixture == "math:0.5,code:0.5"
  assert (c.data.tasks.math.kind, c.data.tasks.code.kind) == ("synthetic", "tiny_code")
  assert (c.data.tasks.math.heldout, c.data.tasks.code.heldout) == (64, 32)
  assert c.model.vocab_size == 40 and c.rollout.answer_budget == 20
  assert c.rl.to_dict() == tiny.rl.to_dict() and c.total_steps == tiny.total_steps == 300
  recipes.validate(c)


def test_expert_axis_must_divide_experts():
  """A mesh whose expert axis does not divide Scout's 16 experts is a config error at start-up."""
  c = _get("scout", "gb200_16")
  c.mesh.shape = (("data", 1), ("fsdp", 2), ("tensor", 1), ("expert", 3))
  with pytest.raises(ValueError, match="does not divide num_experts=16"):
    model_sections.model_config(c)


def _start(c, workdir):
  """What main does at a run's start: validate, then resolve R3."""
  return recipes.resolve_routing_replay(c, recipes.validate(c, str(workdir)))


def test_routing_replay_on_vllm_is_refused_at_start(monkeypatch, tmp_path):
  """R3 with vLLM generators that cannot return routes fails before any process starts (vLLM
  returns routed experts only from its Triton-based Model Runner V2; docs/VLLM.md), not at the
  first learner step; where they can ($SCALERL_VLLM_RECORDS_ROUTES=1 stands for the engines'
  answer), R3 is accepted and on by default for the MoE model (rl.routing_replay_auto). Only at a
  run's start here (a workdir): a fleet render keeps R3 as configured."""
  monkeypatch.setenv("SCALERL_VLLM_RECORDS_ROUTES", "0")
  c = _get("scout")
  c.rl.routing_replay = True
  with pytest.raises(recipes.ConfigError, match=r"routing_replay=True but the vllm generators cannot record routed experts: \$SCALERL_VLLM_RECORDS_ROUTES=0"):
    _start(c, tmp_path)
  c = _get("scout")
  assert not _start(c, tmp_path).rl.routing_replay and not c.rl.routing_replay   # auto: off here
  c.generator.backend = "jax"
  assert _start(c, tmp_path).rl.routing_replay and c.rl.routing_replay          # auto: on
  monkeypatch.setenv("SCALERL_VLLM_RECORDS_ROUTES", "1")
  c = _get("scout")
  assert _start(c, tmp_path).rl.routing_replay                                   # vLLM that can
  c = _get("scout")
  c.rl.routing_replay_auto = False
  assert not _start(c, tmp_path).rl.routing_replay
  c = _get("8b")                                                                 # dense: never
  assert not _start(c, tmp_path).rl.routing_replay
  monkeypatch.setenv("SCALERL_VLLM_RECORDS_ROUTES", "0")
  c = _get("scout")
  c.rl.routing_replay = True
  assert recipes.validate(c).rl.routing_replay        # a render (no workdir): the fleet decides
