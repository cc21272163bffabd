"""launch/preflight.py: each launch fault planted (one at a time) in a rendered variant is caught
with ONE line naming the variant, the number and the knob; the arithmetic it relies on
(run_config.train_seq_len = trainer.pad_time's width, topologies.process_row_spans, the vLLM KV-cache engine
args) checked against the code; the render flags reach every pod."""
import os
import shutil

import numpy as np
import pytest
import yaml

from launch import preflight
from launch import spec as spec_lib
from launch.gke import render
from scalerl_jax import config as run_config

pytestmark = pytest.mark.xdist_group("preflight")
RENDERED = render.RENDERED_DIR


def _docs(d):
  out = {}
  for path in sorted(os.listdir(d)):
    if path.endswith(".yaml"):
      with open(os.path.join(d, path)) as f:
        text = f.read()
      header = "".join(l for l in text.splitlines(True) if l.startswith("#"))
      out[path] = (header, list(yaml.safe_load_all(text)))
  return out


def _write(d, docs):
  for path, (header, ds) in docs.items():
    with open(os.path.join(d, path), "w") as f:
      f.write(render.render_text(ds, header))


def _pod(doc):
  return preflight._pod_spec(doc)


def _find(docs, kind, component=None):
  for _, (_, ds) in docs.items():
    for d in ds:
      if d["kind"] == kind and (component is None or
                                d["metadata"]["labels"]["app.kubernetes.io/component"] == component):
        return d
  raise KeyError(kind)


def _edit_run_config(docs, old, new):
  cm = _find(docs, "ConfigMap")
  text = cm["data"][spec_lib.RUN_CONFIG_FILE]
  assert text.count(old) == 1, old
  cm["data"][spec_lib.RUN_CONFIG_FILE] = text.replace(old, new)


@pytest.fixture(scope="module")
def baseline():
  """Failures of each committed variant as rendered: none."""
  return {v: set(preflight.check_variant(os.path.join(RENDERED, v)).failures)
          for v in ("8b-gb200", "scout-gb200")}


def _plant(tmp_path, variant, edit):
  d = tmp_path / variant
  shutil.copytree(os.path.join(RENDERED, variant), d)
  docs = _docs(d)
  edit(docs)
  _write(d, docs)
  return preflight.check_variant(str(d))


def _new_line(rep, baseline, variant, *needles):
  new = [l for l in rep.failures if l not in baseline[variant]]
  assert len(new) == 1, new
  line = new[0]
  assert line.startswith(f"FAIL {variant}: ") and "\n" not in line and "(knob: " in line, line
  for n in needles:
    assert n in line, (n, line)
  return line


def test_committed_variants_pass(baseline):
  """Re-rendered manifests (python -m launch.gke.render --all) pass every check."""
  assert baseline == {"8b-gb200": set(), "scout-gb200": set()}
  for v in ("8b-h100", "8b-tpu-v5p"):
    assert preflight.check_variant(os.path.join(RENDERED, v)).failures == []


def test_generators_without_the_data_volume(tmp_path, baseline):
  def edit(docs):
    c = _pod(_find(docs, "Deployment", "generator"))["containers"][0]
    c["volumeMounts"] = [m for m in c["volumeMounts"] if m["name"] != "data"]
  rep = _plant(tmp_path, "8b-gb200", edit)
  _new_line(rep, baseline, "8b-gb200", "generator: data.path=/data/polaris-53k.jsonl, "
            "data.tokenizer_path=/data/tokenizer/llama3_8b, model.hf_checkpoint=/data/checkpoints/"
            "llama3_8b are on no volume the generator pod mounts", "--data_pvc")


def test_empty_data_path(tmp_path, baseline):
  rep = _plant(tmp_path, "8b-gb200", lambda docs: _edit_run_config(
      docs, "'path': '/data/polaris-53k.jsonl'", "'path': ''"))
  _new_line(rep, baseline, "8b-gb200", "learner: data.path is empty", "--data")


def test_override_on_the_learner_only(tmp_path, baseline):
  def edit(docs):
    c = _pod(_find(docs, "JobSet"))["containers"][0]
    c["command"].append("--config.rollout.max_lag=4")
  rep = _plant(tmp_path, "8b-gb200", edit)
  _new_line(rep, baseline, "8b-gb200", "the learner's rollout.max_lag=4 reaches no other pod: "
            "generators rollout.max_lag=8, buffer rollout.max_lag=8", "--override")


def test_fp32_weight_push(tmp_path, baseline):
  rep = _plant(tmp_path, "8b-gb200", lambda docs: _edit_run_config(
      docs, "'wire_dtype': 'bfloat16'", "'wire_dtype': 'float32'"))
  new = [l for l in rep.failures if l not in baseline["8b-gb200"]]
  # the push line, the generator's held versions at 4 bytes/param outgrow its request
  assert any("weight push 4 bytes/param = 32.1 GB per generator, 2.6 s at 12.5 GB/s" in l and
             "target 2 bytes/param" in l and "weights.wire_dtype" in l for l in new), new
  # 3 versions + the relay's copy at 4 B/param: 4 x 8.03e9 x 4 B = 119.6 GiB + vLLM 16 GiB
  assert any("generator memory request 88 GiB < 136 GiB" in l for l in new), new
  # and a float32 wire sends full versions (no deltas): 4 bytes/param at the measured stream rate
  # (launch/weight_rate.json); the variant fails on sync exactly when that is slower than a step
  sync = [l for l in rep.infos + rep.failures if "weight sync" in l]
  assert sync and "(full;" in sync[0] and "32.1 GB on the wire" in sync[0], sync
  got = float(sync[0].split("weight sync ")[1].split(" s per version")[0])
  step = float(sync[0].split("learner step ")[1].split(" s at")[0])
  slow = [l for l in new if "sync slower than a step" in l]
  assert len(slow) == (got > step) and len(new) == 2 + (got > step), (got, step, new)


def test_fixed_512_mib_kv_cache(tmp_path, baseline):
  rep = _plant(tmp_path, "8b-gb200", lambda docs: _edit_run_config(
      docs, "'kv_cache_bytes': 0", "'kv_cache_bytes': 536870912"))
  _new_line(rep, baseline, "8b-gb200", "vLLM KV cache 0.5 GiB (kv_cache_bytes=536870912) holds 0 "
            "of max_num_seqs=64 sequences of 16464 tokens (2.01 GiB each)",
            "generator.decode_batch / gpu_memory_utilization / kv_cache_bytes")


def test_learner_layout_of_another_platform(tmp_path, baseline):
  def edit(docs):
    c = _pod(_find(docs, "JobSet"))["containers"][0]
    c["command"] = [a.replace(":gb200_16", "") for a in c["command"]] + ["--config.topology=h100_16"]
  rep = _plant(tmp_path, "8b-gb200", edit)
  _new_line(rep, baseline, "8b-gb200", "learner layout h100_16 is for 16 gpu-h100 devices, the "
            "JobSet runs 4 hosts x 4 gpu-gb200 = 16", "--layout")


def test_scout_layout_needing_32_devices(tmp_path, baseline):
  def edit(docs):
    c = _pod(_find(docs, "JobSet"))["containers"][0]
    c["command"] = [a.replace(":gb200_16", "") for a in c["command"]] + ["--config.topology=gb200_32"]
  rep = _plant(tmp_path, "scout-gb200", edit)
  new = [l for l in rep.failures if l not in baseline["scout-gb200"]]
  assert any("learner layout gb200_32 is for 32 gpu-gb200 devices, the JobSet runs 4 hosts x 4 "
             "gpu-gb200 = 16" in l for l in new), new
  # no plan of gb200_32 at the pad length either (the padding line names the new layout)
  assert all(l.startswith("FAIL scout-gb200: ") and "(knob: " in l for l in new)


def test_micro_batches_that_do_not_split(tmp_path, baseline):
  def edit(docs):        # optim.microbatches: the one just before optim's 'warmup_steps'
    cm = _find(docs, "ConfigMap")
    text = cm["data"][spec_lib.RUN_CONFIG_FILE]
    i = text.rindex("'microbatches': 192", 0, text.index("'warmup_steps'"))
    cm["data"][spec_lib.RUN_CONFIG_FILE] = text[:i] + "'microbatches': 384" + text[i + 19:]
  rep = _plant(tmp_path, "8b-gb200", edit)
  new = [l for l in rep.failures if l not in baseline["8b-gb200"]]
  assert any("768 rows / 384 micro-batches do not split over 4 batch shards" in l
             and "optim.microbatches" in l for l in new), new


def test_xla_memory_fraction_unset(tmp_path, baseline):
  def edit(docs):
    c = _pod(_find(docs, "JobSet"))["containers"][0]
    c["env"] = [e for e in c["env"] if e["name"] != "XLA_PYTHON_CLIENT_MEM_FRACTION"]
  rep = _plant(tmp_path, "8b-gb200", edit)
  _new_line(rep, baseline, "8b-gb200", "XLA_PYTHON_CLIENT_MEM_FRACTION=None", "assumes 0.9")


@pytest.mark.parametrize("component", ["generator", "buffer", "learner"])
def test_no_liveness_probe(tmp_path, baseline, component):
  def edit(docs):
    doc = _find(docs, "JobSet") if component == "learner" else _find(docs, "Deployment", component)
    _pod(doc)["containers"][0].pop("livenessProbe")
  rep = _plant(tmp_path, "8b-gb200", edit)
  _new_line(rep, baseline, "8b-gb200", f"{component} container", "has no livenessProbe")


@pytest.mark.parametrize("component", ["buffer", "learner"])
def test_a_port_probe_is_not_liveness_from_progress(tmp_path, baseline, component):
  def edit(docs):   # what the manifests had before issue 46: the port is open, work may be stuck
    doc = _find(docs, "JobSet") if component == "learner" else _find(docs, "Deployment", component)
    port = "weights" if component == "learner" else "grpc"
    _pod(doc)["containers"][0]["livenessProbe"] = {"tcpSocket": {"port": port}, "periodSeconds": 30}
  rep = _plant(tmp_path, "8b-gb200", edit)
  _new_line(rep, baseline, "8b-gb200", f"{component} liveness is not from progress",
            "_progress_probe")


def test_generator_memory_for_more_held_versions(tmp_path, baseline):
  rep = _plant(tmp_path, "8b-gb200", lambda docs: _edit_run_config(
      docs, "'eval_hold_versions': 2", "'eval_hold_versions': 6"))
  # 7 versions + the relay's copy: 8 x 8.03e9 x 2 B = 119.6 GiB + vLLM 16 GiB
  _new_line(rep, baseline, "8b-gb200", "generator memory request 88 GiB < 136 GiB it holds "
            "(7 weight versions + relay copy", "generator.eval_hold_versions")


def test_main_config_files_with_no_data_and_default_layout(tmp_path, baseline):
  """The manifests as they were (every pod reads configs/8b.py baked into the image: layout
  h100_16 everywhere, no data, no probes, no XLA fraction): each fault its line."""
  def edit(docs):
    for doc in (_find(docs, "JobSet"), _find(docs, "Deployment", "generator"),
                _find(docs, "Deployment", "buffer")):
      pod = _pod(doc)
      for c in pod.get("initContainers", []) + pod["containers"]:
        c["command"] = [("--config=configs/8b.py" if a.startswith("--config=/etc") else
                         "--run_config=configs/8b.py" if a.startswith("--run_config=") else a)
                        for a in c["command"]]
        c.pop("livenessProbe", None)
        c["env"] = [e for e in c.get("env", []) if e["name"] != "XLA_PYTHON_CLIENT_MEM_FRACTION"]
  rep = _plant(tmp_path, "8b-gb200", edit)
  text = "\n".join(rep.failures)
  for needle in ("learner layout h100_16 is for 16 gpu-h100 devices", "data.path is empty",
                 "data.tokenizer_path is empty", "model.hf_checkpoint is empty",
                 "XLA_PYTHON_CLIENT_MEM_FRACTION=None", "learner container learner has no "
                 "livenessProbe", "generator container vllm has no livenessProbe"):
    assert needle in text, (needle, text)


# ---- the arithmetic, against the code --------------------------------------------------------------
def test_train_seq_len_is_what_pad_time_pads_a_longest_batch_to():
  """run_config.train_seq_len (the plan tool's default length, the preflight's check) is the width
  trainer.pad_time gives a batch holding a longest sequence."""
  from scalerl_jax.tools.plan import default_seq_len
  from scalerl_jax.training.trainer import pad_time
  c = spec_lib.load_config(os.path.join(preflight.REPO, "configs/8b.py"))
  longest = run_config.max_sequence_len(c.rollout)
  assert longest == 2048 + 12288 + 64 + 2048 == 16448
  got = pad_time({"tokens": np.zeros((1, longest), np.int32)}, int(c.learner.pad_multiple),
                 longest)["tokens"].shape[1]
  assert got == run_config.train_seq_len(c) == default_seq_len(c) == 16448
  c.learner.pad_multiple = 1000
  assert run_config.train_seq_len(c) == 16448                 # clamped to the longest sequence


def test_process_row_spans():
  from scalerl_jax import topologies
  c8 = spec_lib.load_config(os.path.join(preflight.REPO, "configs/8b.py"), "h100_16")
  # tensor 8 over 4-GPU hosts: two processes share each half of the batch (replicated over tensor)
  spans = topologies.process_row_spans(c8.mesh.shape, c8.mesh.rules, 4, 768)
  assert spans == [(0, 384), (0, 384), (384, 768), (384, 768)]
  assert topologies.even_process_split(384, 768, 4)
  # sequence-parallel Scout on 16 GPUs: the batch is replicated over all four processes
  cs = spec_lib.load_config(os.path.join(preflight.REPO, "configs/scout.py"), "gb200_16")
  assert topologies.process_row_spans(cs.mesh.shape, cs.mesh.rules, 4, 768) == [(0, 768)] * 4
  assert topologies.even_process_split(768, 768, 4)
  assert not topologies.even_process_split(256, 768, 4)      # 3 slices over 4 processes
  with pytest.raises(ValueError, match="not contiguous"):
    topologies.process_row_spans((("fsdp", 2), ("tensor", 2), ("data", 2)),
                                 (("batch", ("data", "fsdp")),), 4, 8)
  with pytest.raises(ValueError, match="do not split over 16 batch shards"):
    topologies.process_row_spans((("data", 1), ("fsdp", 16), ("tensor", 1), ("expert", 1)),
                                 (("batch", ("data", "fsdp", "expert")),), 4, 24)


def test_vllm_engine_args_size_the_kv_cache_from_gpu_memory():
  """The generator passes no fixed KV size: on GPU vLLM's gpu_memory_utilization, concurrency
  from generator.decode_batch; an explicit generator.kv_cache_bytes is the override."""
  import inspect

  from scalerl_jax.generation.vllm import engine as gen_worker
  from scalerl_jax.generation.vllm import worker as vllm_worker
  from scalerl_jax.generation.vllm.generator import VLLMGenerator
  assert inspect.signature(VLLMGenerator).parameters["kv_cache_bytes"].default is None
  c = spec_lib.load_config(os.path.join(preflight.REPO, "configs/8b.py"))
  args = gen_worker.vllm_args(c.generator)
  assert (args["kv_cache_bytes"], args["gpu_memory_utilization"], args["max_num_seqs"]) == \
      (None, 0.9, 64)
  cfg = dict(vllm_worker.DEFAULTS, kv_cache_bytes=args["kv_cache_bytes"],
             gpu_memory_utilization=0.9)
  assert vllm_worker.kv_cache_args(cfg, on_gpu=True) == {"gpu_memory_utilization": 0.9}
  assert vllm_worker.kv_cache_args(cfg, on_gpu=False) == {
      "kv_cache_memory_bytes": vllm_worker.CPU_KV_CACHE_BYTES}
  c.generator.kv_cache_bytes = 8 << 30
  cfg["kv_cache_bytes"] = gen_worker.vllm_args(c.generator)["kv_cache_bytes"]
  assert vllm_worker.kv_cache_args(cfg, on_gpu=True) == {"kv_cache_memory_bytes": 8 << 30}


def test_resolved_config_is_not_re_recipied():
  """The run config carries its recipe applied once: main / the generator applying it again
  would undo the render's overrides (and scale prompts_per_step twice)."""
  c = spec_lib.load_config(os.path.join(preflight.REPO, "configs/8b.py"))
  c.recipe = "qwen_dapo"        # 80 x 16 prompts, prompt-level aggregation
  s = render.variant_settings("configs/8b.py", "gpu-gb200", "gpu-gb200",
                              {"config_overrides": ("rl.aggregation=sample", "optim.microbatches=16"),
                               "layout": "gb200_16", "train_chips": 16})
  run_cfg, _ = spec_lib.resolve_run_config(c, dict(spec_lib.LAUNCH_DEFAULTS, **s), 1)
  assert run_cfg.rollout.prompts_per_step == 80 and run_cfg.rl.aggregation == "sample"
  again = run_config.apply_recipe(run_cfg)
  assert again.rollout.prompts_per_step == 80 and again.rl.aggregation == "sample"


# ---- the render flags --------------------------------------------------------------------------
def test_render_flags_reach_every_pod(tmp_path):
  out = tmp_path / "v"
  render.main(["--config=configs/8b.py", "--learner_platform=gpu-h100",
               "--generator_platform=gpu-h100", "--workdir=gs://my-bucket/run7",
               "--image_prefix=reg.example/p", "--image_tag=t1",
               "--image=vllm=reg.example/custom/vllm@sha256:abc", "--namespace=rl",
               "--data=/data/mine.jsonl", "--tokenizer=/data/tok", "--checkpoint=/data/ck",
               "--override", "rollout.max_lag=4", "--override", "generator.decode_batch=8",
               "--no-preflight", f"--out={out}"])
  docs = _docs(out)
  cm = _find(docs, "ConfigMap")
  text = cm["data"][spec_lib.RUN_CONFIG_FILE]
  for needle in ("'max_lag': 4", "'decode_batch': 8", "'path': '/data/mine.jsonl'",
                 "'tokenizer_path': '/data/tok'", "'hf_checkpoint': '/data/ck'", "LAYOUT = 'h100_16'"):
    assert needle in text, needle
  images = {}
  for _, (_, ds) in docs.items():
    for d in ds:
      assert d["metadata"]["namespace"] == "rl"
      if d["kind"] in ("JobSet", "Deployment"):
        pod = _pod(d)
        for c in pod.get("initContainers", []) + pod["containers"]:
          if c["name"] == "selftest":   # the start-up self-test runs in the pod's main image
            assert c["image"] == pod["containers"][0]["image"] and "scalerl_jax.selftest" in c["command"]
            continue
          images[c["name"]] = c["image"]
          assert not any(a.startswith("--config.rollout") for a in c["command"])   # from the file
  assert images == {"learner": "reg.example/p/scalerl-jax-learner-gpu:t1",
                    "vllm": "reg.example/custom/vllm@sha256:abc",
                    "export-prompts": "reg.example/p/scalerl-jax-buffer:t1",
                    "buffer": "reg.example/p/scalerl-jax-buffer:t1"}
  b = _pod(_find(docs, "Deployment", "buffer"))["containers"][0]
  assert f"--run-config={spec_lib.RUN_CONFIG_PATH}" in b["command"]   # max_lag 4: the file's
  assert "--learner-state=gs://my-bucket/run7/learner_state.json" in b["command"]
  rep = preflight.check_variant(str(out))
  assert not [l for l in rep.failures if "max_lag" in l or "on no volume" in l or "KV" in l]


def test_render_refuses_bad_flags(tmp_path):
  for args, msg in ((["--tokenizer=gs://b/tok"], "a path on the data volume"),
                    (["--image=gpu=x"], "unknown image role"),
                    (["--override", "rollout.max_lag"], "expected key=value"),
                    (["--override", "rollout.nope=1"], "unknown config field"),
                    (["--learner_platform=gpu-gb200", "--layout=tpu_v5p_16"], "")):
    with pytest.raises(SystemExit) as e:
      render.main(["--config=configs/8b.py", "--no-preflight", f"--out={tmp_path}/x", *args])
    assert "render: error:" in str(e.value) and msg in str(e.value), (args, str(e.value))


def test_dockerfile_targets_and_copies():
  """docker/Dockerfile: one target per image role, every COPY source exists in the repo."""
  path = os.path.join(preflight.REPO, "docker", "Dockerfile")
  lines = open(path).read().splitlines()
  targets = {l.split()[-1] for l in lines if l.startswith("FROM ") and " AS " in l}
  assert set(spec_lib.ROLES) <= targets, targets
  copies = [l.split()[1:-1] for l in lines if l.startswith("COPY ")]
  assert copies
  for srcs in copies:
    for src in srcs:
      assert os.path.exists(os.path.join(preflight.REPO, src)), src
  assert any("requirements.txt" in s for s in copies)


def test_weight_sync_slower_than_a_step(tmp_path, baseline):
  """Scout without relays and deltas: 16 generators each fetch the whole 215.5 GB bf16 model
  from the 4 learner hosts' sources, longer than a learner step: one line with the numbers and
  the knobs (the rate is bench.weights' measured file where it exists, else the given one)."""
  from launch import sizing

  def edit(docs):
    _edit_run_config(docs, "'relay_fanout': 2", "'relay_fanout': 0")
    _edit_run_config(docs, "'delta': True", "'delta': False")
  rep = _plant(tmp_path, "scout-gb200", edit)
  rates = sizing.sync_rates()
  want = 16 * 215.5e9 / (4 * min(rates["stream"], 12.5e9))     # G copies from 4 hosts
  line = _new_line(rep, baseline, "scout-gb200", "sync slower than a step",
                   "weights.relay_fanout / weights.delta", "relay fan-out 0", "for 16 generators")
  got = float(line.split("weight sync ")[1].split(" s per version")[0])
  assert abs(got - want) / want < 0.01, (got, want)
  step = float(line.split("learner step ")[1].split(" s at")[0])
  assert got > step > 60, line
