"""The chaos harness's faults of issue 46 (harness/chaos.py draws and fires them; kept apart from it
for the module-size cap). Opt-in: name them in `--kinds` (docs/RELIABILITY.md "Chaos runs").

  hostile_answer  the run's generators are the `scripted` backend on an arithmetic task graded by
                  the math reward (in grading processes: rewards/isolation.py), every
                  HOSTILE_EVERY-th sample boxing one of generation/fake.py's HOSTILE_ANSWERS
                  (`generator.scripted_hostile_every`), guards off, so that only the grading
                  deadline (GRADE_TIMEOUT_S) stops them. Model output is the fault's source: it is
                  in effect from the first step to the last, under every other fault; its planned
                  moment records the grade timeouts counted so far.
  sigterm         SIGTERM with grace, to a generator (it gives its leases back at once and exits
                  0; the supervisor restarts it) or, every other time once a checkpoint
                  exists, to the learner (a final checkpoint when
                  `checkpoint.termination_grace_s` = GRACE_S allows it, then it exits; the harness
                  runs the same command again). A process still alive GRACE_S after its SIGTERM is
                  SIGKILLed, as the kubelet would, and the invariant fails.

Invariants added to the audit's: `hostile_answers_scored_zero` (grade timeouts were counted, and
every graded-by-fault line of the generators' reward logs has reward 0) and
`sigterm_exits_within_grace` (every SIGTERMed process left on its own within the grace period:
a generator with exit 0 and its leases released, the learner with exit 0 and one decision line).
"""
from __future__ import annotations

import glob
import json
import os
import signal
import time
from typing import Any

from harness.procs import alive, argv, descendants

KINDS = ("hostile_answer", "sigterm")
ORDER = {"hostile_answer": -1, "sigterm": 5}   # pairs: the lasting fault first (chaos._ORDER)
HOSTILE_EVERY = 24      # every 24th sample boxes a hostile answer
GRADE_TIMEOUT_S = 2.0   # the grading deadline those answers meet
GRACE_S = 60.0          # checkpoint.termination_grace_s of the chaos run
GRADE_FAULTS = ("grade_timeout", "grade_oom", "grade_error", "grade_guard")
DECISION = ("SIGTERM: final checkpoint written", "SIGTERM: no final checkpoint")


def run_overrides(kinds, work_dir: str, run_dir: str) -> list[str]:
  """The run's extra `--config.` overrides for the chosen kinds; for hostile_answer also writes
  its tokenizer and problems (under `work_dir`, outside a tmpfs that a disk_full fault fills) and
  the start policy (`run_dir`/base_policy: a math dataset has no SFT traces)."""
  out = []
  if "sigterm" in kinds:
    out.append(f"--config.checkpoint.termination_grace_s={GRACE_S}")
  if "hostile_answer" in kinds:
    out += _hostile_setup(os.path.join(work_dir, "hostile"), run_dir)
  return out


def _hostile_setup(data_dir: str, run_dir: str) -> list[str]:
  import jax  # local: JAX only for the hostile_answer run's start policy
  from scalerl_jax import config, models  # local: the start policy, only for hostile_answer
  from scalerl_jax.models import sections as model_sections  # local: the start policy, only for hostile_answer
  from scalerl_jax.data.tiny_hf_tokenizer import write_llama3_style_tokenizer  # local: as above
  model = ["--config.model.vocab_size=512", "--config.model.max_position_embeddings=256",
           "--config.model.num_layers=1", "--config.model.d_model=64",
           "--config.model.num_heads=1", "--config.model.ffn_dim=128"]
  os.makedirs(data_dir, exist_ok=True)
  tok = write_llama3_style_tokenizer(os.path.join(data_dir, "tok"), vocab_size=512)
  rows = [{"problem": f"What is {a} + {b}?", "answer": str(a + b)}
          for a in range(3, 11) for b in range(11, 19)]
  data = os.path.join(data_dir, "math.jsonl")
  with open(data, "w") as f:
    f.write("".join(json.dumps(r) + "\n" for r in rows))
  base = os.path.join(run_dir, "base_policy")
  if not os.path.exists(os.path.join(base, "config.json")):
    cfg = model_sections.model_config(config.resolve_config("configs/tiny.py", model))
    models.save_hf(cfg, jax.device_get(models.init_params(cfg, jax.random.PRNGKey(0))), base)
  return model + [
      "--config.data.kind=polaris", f"--config.data.path={data}",
      f"--config.data.tokenizer_path={tok}", "--config.data.template=reasoning_instruct",
      "--config.generator.backend=scripted", "--config.generator.continuous=True",
      f"--config.generator.scripted_hostile_every={HOSTILE_EVERY}",
      f"--config.rewards.grade_timeout_s={GRADE_TIMEOUT_S}", "--config.rewards.grade_guard=False",
      "--config.rewards.log=True", "--config.eval.mode=fleet",
      "--config.rollout.max_prompt_len=96", "--config.rollout.think_budget_min=48",
      "--config.rollout.think_budget_max=64", "--config.rollout.answer_budget=32",
      "--config.health.step0_min_samples=64", "--config.pin_cpus=False"]


def ready(chaos, kind: str):
  """The fault's target once it exists (None: not yet): hostile_answer needs a stepping run;
  sigterm picks a generator's pid or "learner" (seeded)."""
  if chaos.learner is None or chaos.learner.poll() is not None or not chaos.stepping():
    return None
  if kind == "hostile_answer":
    return True
  gens = sorted(chaos._gens())
  done = [f.get("target") for f in chaos.faults if f["kind"] == "sigterm"]
  # Every other SIGTERM is the learner's, once it has a checkpoint to resume from (waited for).
  if done.count("learner") < done.count("generator"):
    return "learner" if chaos.valid_checkpoints() else None
  return gens[chaos.rng.randrange(len(gens))] if gens else None


def inject(chaos, kind: str, target, f: dict) -> dict:
  """Fires one fault of KINDS; `f` is its record so far (kind, t, step, learner_run)."""
  if kind == "hostile_answer":
    f["grade_timeouts_so_far"] = grade_counts(chaos.run_dir).get("gen_grade_timeout", 0)
    f["_end"] = lambda: False   # in effect for the whole run (its window never closes)
    return f
  now = time.time()
  if target == "learner":
    f.update(target="learner", pid=chaos.learner.pid)
    chaos.seen_pids.update(descendants(chaos.learner.pid))
    chaos.planned_kill = True    # its exit is the fault's: the harness reruns the command
    run = chaos.runs
    os.kill(chaos.learner.pid, signal.SIGTERM)
    chaos.timers.append((now + GRACE_S, lambda p=chaos.learner: _kill_after_grace(chaos, f, p)))
    f["_end"] = lambda: chaos.runs > run and chaos.learner.poll() is None and bool(chaos._buffer())
  else:
    a = argv(target)
    f.update(target="generator", pid=target,
             name=a[a.index("--generator_id") + 1] if "--generator_id" in a else "?")
    os.kill(target, signal.SIGTERM)
    chaos.timers.append((now + GRACE_S, lambda: _kill_after_grace(chaos, f, target)))
    f["_end"] = lambda: not alive(target) and len(set(chaos._gens()) - {target}) >= 2
  return f


def _kill_after_grace(chaos, f: dict, proc) -> None:
  """The kubelet's SIGKILL at the end of the grace period, if the process is still there."""
  pid = proc if isinstance(proc, int) else proc.pid
  still = alive(pid) if isinstance(proc, int) else proc.poll() is None
  if still:
    f["killed_after_grace"] = True
    chaos.log(f"sigterm: pid {pid} still alive {GRACE_S:.0f} s after SIGTERM: SIGKILL")
    os.kill(pid, signal.SIGKILL)


def grade_counts(run_dir: str) -> dict:
  """The largest gen_graded / gen_grade_* values in metrics.jsonl's train lines (cumulative)."""
  out: dict[str, float] = {}
  try:
    lines = open(os.path.join(run_dir, "metrics.jsonl")).read().splitlines()
  except OSError:
    return out
  for l in lines:
    try:
      rec = json.loads(l)
    except ValueError:
      continue
    for k, v in rec.items():
      if (k == "gen_graded" or k.startswith("gen_grade_")) and isinstance(v, (int, float)):
        out[k] = max(out.get(k, 0), v)
  return out


def invariants(chaos) -> tuple[dict, dict]:
  """(invariants, details) of the chosen KINDS (empty when none was chosen)."""
  inv: dict[str, bool] = {}
  det: dict[str, Any] = {}
  if "hostile_answer" in chaos.kinds:
    counts = grade_counts(chaos.run_dir)
    faulted = nonzero = 0
    for p in glob.glob(os.path.join(chaos.run_dir, "logs", "rewards-*.jsonl")):
      for l in open(p):
        try:
          rec = json.loads(l)
        except ValueError:
          continue            # a line cut by a kill -9
        if rec.get("reason") in GRADE_FAULTS:
          faulted += 1
          nonzero += rec.get("reward") != 0
    inv["hostile_answers_scored_zero"] = counts.get("gen_grade_timeout", 0) > 0 and faulted > 0 \
        and nonzero == 0
    det["hostile_answers_scored_zero"] = (
        f"metrics {json.dumps({k: counts[k] for k in sorted(counts)})}; reward logs: {faulted} "
        f"grades scored by a fault, {nonzero} of them not 0")
  if "sigterm" in chaos.kinds:
    sig = [f for f in chaos.faults if f["kind"] == "sigterm"]
    bad = [_sigterm_problem(chaos, f) for f in sig]
    bad = [b for b in bad if b]
    inv["sigterm_exits_within_grace"] = not bad
    det["sigterm_exits_within_grace"] = (
        f"{len(sig)} SIGTERMs ({sum(f.get('target') == 'learner' for f in sig)} to the learner), "
        f"grace {GRACE_S:.0f} s; " + ("; ".join(bad) if bad else "each left on its own"))
  return inv, det


def _sigterm_problem(chaos, f: dict) -> str:
  """Why one SIGTERM fault broke its promise ("" when it kept it)."""
  if f.get("killed_after_grace"):
    return f"{f.get('target')} pid {f['pid']} outlived the grace period"
  if f.get("target") == "learner":
    ex = [e for e in chaos.exits if e["run"] == f["learner_run"]]
    if not ex or ex[0]["returncode"] != 0:
      return f"learner run {f['learner_run']} exited with {ex[0]['returncode'] if ex else '?'}"
    log = open(os.path.join(chaos.dir, f"learner-{f['learner_run']:03d}.log"),
               errors="replace").read()
    n = sum(log.count(d) for d in DECISION)
    return "" if n == 1 else f"learner run {f['learner_run']} logged {n} SIGTERM decisions"
  name = f.get("name", "?")
  try:
    events = [json.loads(l) for l in open(os.path.join(chaos.run_dir, "logs", "supervisor.log"))]
  except OSError:
    events = []
  # Its exit status is known where the supervisor restarted it (a learner killed meanwhile takes
  # its supervisor along): any seen must be 0.
  codes = [e["returncode"] for e in events if e["name"] == name
           and e.get("t", 0) >= chaos.t0 + f["t"] - 1]
  if codes and codes[0] != 0:
    return f"generator {name} (pid {f['pid']}) exited with {codes[0]} after its SIGTERM"
  try:
    log = open(os.path.join(chaos.run_dir, "logs", f"{name}.log"), errors="replace").read()
  except OSError:
    log = ""
  return "" if "SIGTERM: released" in log else f"generator {name} logged no lease release"
