"""Builds tests/data/math_pairs.jsonl: (answer, gold, kind, reward) with the reward math-verify gave
at commit 64759ef (before process-isolated grading), graded on the main thread.

  PYTHONPATH=. python tests/data/make_math_pairs.py tests/data/math_pairs.jsonl
"""
import json, sys
from scalerl_jax.rewards import math as m
C = []
def add(ans, gold, kind): C.append((ans, gold, kind))
# fractions
for a, b in [(1,2),(3,4),(2,3),(5,7),(7,9),(11,13),(13,17),(1,6),(5,12),(9,16),(17,20),(3,8),(7,11),(19,23),(4,9)]:
  add(f"\\boxed{{\\frac{{{a}}}{{{b}}}}}", f"\\frac{{{a}}}{{{b}}}", "fraction")
  add(f"\\boxed{{\\dfrac{{{a}}}{{{b}}}}}", f"{a}/{b}", "fraction")
  add(f"The answer is $\\frac{{{a}}}{{{b}}}$.", f"\\frac{{{a}}}{{{b}}}", "fraction")
  add(f"\\boxed{{{a}/{b}}}", f"\\tfrac{{{a}}}{{{b}}}", "fraction")
  add(f"\\boxed{{-\\frac{{{a}}}{{{b}}}}}", f"-\\frac{{{a}}}{{{b}}}", "fraction")
# radicals
for n in [2,3,5,6,7,10,11,13,14,15,17,19]:
  add(f"\\boxed{{\\sqrt{{{n}}}}}", f"\\sqrt{{{n}}}", "radical")
  add(f"\\boxed{{2\\sqrt{{{n}}}}}", f"\\sqrt{{{4*n}}}", "radical")
  add(f"\\boxed{{\\frac{{\\sqrt{{{n}}}}}{{2}}}}", f"\\frac{{\\sqrt{{{n}}}}}{{2}}", "radical")
  add(f"\\boxed{{1+\\sqrt{{{n}}}}}", f"\\sqrt{{{n}}}+1", "radical")
  add(f"\\boxed{{\\sqrt[3]{{{n}}}}}", f"{n}^{{1/3}}", "radical")
# intervals
for a, b in [(0,1),(1,2),(-3,5),(2,7),(-1,4),(0,10),(3,9),(-5,-1),(4,8),(6,12)]:
  add(f"\\boxed{{({a},{b})}}", f"({a}, {b})", "interval")
  add(f"\\boxed{{[{a},{b}]}}", f"\\left[{a}, {b}\\right]", "interval")
  add(f"\\boxed{{({a},{b}]}}", f"({a},{b}]", "interval")
  add(f"\\boxed{{[{a}, \\infty)}}", f"[{a},\\infty)", "interval")
# LaTeX variants: integers, decimals, pi, text, degrees, sets, equations
for k in [0,1,7,12,42,100,256,1000,2024,99999]:
  add(f"\\boxed{{{k}}}", str(k), "integer")
  add(f"Thus the final answer is $\\boxed{{{k}}}$", f"{k}", "latex")
  add(f"\\boxed{{x = {k}}}", str(k), "latex")
for k in [1000, 12345, 1000000]:
  add(f"\\boxed{{{k:,}}}".replace(",", "{,}"), str(k), "latex")
for x in ["0.5","2.25","3.75","0.125","1.5"]:
  add(f"\\boxed{{{x}}}", x, "decimal")
for e, g in [("\\pi","\\pi"),("2\\pi","2\\pi"),("\\frac{\\pi}{4}","\\pi/4"),("3\\pi","3\\pi"),("\\frac{3\\pi}{2}","\\frac{3\\pi}{2}")]:
  add(f"\\boxed{{{e}}}", g, "latex")
for s in ["\\{1,2,3\\}", "\\{-1, 4\\}", "\\{0\\}"]:
  add(f"\\boxed{{{s}}}", s, "latex")
for e, g in [("x^2+2x+1","(x+1)^2"),("2x+3","3+2x"),("\\frac{x}{2}","x/2"),("a^2-b^2","(a-b)(a+b)"),("e^{2}","e^2")]:
  add(f"\\boxed{{{e}}}", g, "latex")
for d in [30,45,60,90,120]:
  add(f"\\boxed{{{d}^\\circ}}", str(d), "latex")
for e in ["\\text{(A)}", "\\textbf{(B)}"]:
  add(f"\\boxed{{{e}}}", e.split("{")[1].rstrip("}"), "latex")
out = []
for ans, gold, kind in C:
  r = m.math_reward("<think>x</think> " + ans, gold)
  out.append({"answer": ans, "gold": gold, "kind": kind, "reward": r})
ok = [o for o in out if o["reward"] == 1.0]
print(len(C), "candidates", len(ok), "grade 1.0", file=sys.stderr)
for o in out:
  if o["reward"] != 1.0: print("NOT 1:", o, file=sys.stderr)
with open(sys.argv[1], "w") as f:
  for o in ok: f.write(json.dumps(o) + "\n")
neg = []
for i in range(0, len(ok), 6):
  o, p = ok[i], ok[(i + 7) % len(ok)]
  r = m.math_reward("<think>x</think> " + o["answer"], p["gold"])
  neg.append({"answer": o["answer"], "gold": p["gold"], "kind": "wrong", "reward": r})
print(len(neg), "negatives", sum(n["reward"] for n in neg), "of them 1.0", file=sys.stderr)
with open(sys.argv[1], "a") as f:
  for o in neg: f.write(json.dumps(o) + "\n")
