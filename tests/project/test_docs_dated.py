"""Docs a newcomer can date (issue #47 item 5): README.md, docs/ and every source folder name a
measured number by its date, commit and machine, never by the working session it was made in.

The checker greps for "session" followed by a number (case-insensitive; also across a line
break, as a wrapped comment or paragraph has it). NOTES.md, the dated changelog, is scanned too:
its older entries are labelled by date and order in the day. No JAX: this runs in well under a
second.
"""
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: What is scanned, relative to the repository root: top-level files and whole folders.
FILES = ("README.md", "NOTES.md", "Makefile", "pyproject.toml", "requirements.txt", "requirements-nodeps.txt")
FOLDERS = ("docs", "scalerl_jax", "analysis", "launch", "harness", "bench", "configs", "tests",
           "scripts", "docker", "typings")
SKIP_DIRS = {".git", "__pycache__", ".pytest_cache", ".ruff_cache"}
# The word, singular or plural, any case, then a space or hyphen and a digit; or the word ending a
# line whose next line starts (after comment/quote markers) with a digit.
PATTERN = re.compile(r"\bsessions?[ -][0-9]|\bsessions?[ \t]*\n[ \t#:*>\"'|-]*[0-9]", re.IGNORECASE)


def _scanned(root: str):
  for name in FILES:
    path = os.path.join(root, name)
    if os.path.isfile(path):
      yield path
  for folder in FOLDERS:
    for dirpath, dirnames, filenames in os.walk(os.path.join(root, folder)):
      dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.startswith(".venv"))
      for name in sorted(filenames):
        yield os.path.join(dirpath, name)


def undated_mentions(root: str) -> list[str]:
  """Every "session N" under `root`'s scanned files, as "relative/path:line: text"."""
  found = []
  for path in _scanned(root):
    with open(path, "rb") as f:
      raw = f.read()
    if b"\0" in raw[:8192]:
      continue                                   # binary (a PNG beside its JSON)
    text = raw.decode("utf-8", errors="replace")
    for m in PATTERN.finditer(text):
      line = text.count("\n", 0, m.start()) + 1
      snippet = text.splitlines()[line - 1].strip()[:100]
      found.append(f"{os.path.relpath(path, root)}:{line}: {snippet}")
  return found


def test_no_session_numbers_in_docs_or_sources():
  found = undated_mentions(ROOT)
  assert not found, ("name the date, commit and machine instead of a session:\n" + "\n".join(found))


def test_checker_finds_planted_mentions(tmp_path):
  word = "Sess" + "ion"                          # not written whole here, or this file would fail
  (tmp_path / "docs").mkdir()
  (tmp_path / "docs" / "X.md").write_text(f"clean line\nMeasured in {word} 26: 1.4x.\n")
  (tmp_path / "analysis").mkdir()
  (tmp_path / "analysis" / "m.py").write_text(f"x = 1\n# dropped for time in {word.lower()}\n# 19: ok\n")
  (tmp_path / "NOTES.md").write_text(f"## {word} 26\n")
  (tmp_path / "README.md").write_text(f"{word.lower()}s 23-24 ran on a Xeon\n")
  (tmp_path / "tests" / ".venv").mkdir(parents=True)                  # not scanned
  (tmp_path / "tests" / ".venv" / "lib.py").write_text(f"# {word} 3\n")
  (tmp_path / "docs" / "ok.md").write_text(f"a new {word.lower()} keyring; start_new_{word.lower()}=True\n")
  found = undated_mentions(str(tmp_path))
  assert [f.split(": ")[0] for f in found] == ["README.md:1", "NOTES.md:1", "docs/X.md:2",
                                               "analysis/m.py:2"]
  assert found[2].endswith(f"Measured in {word} 26: 1.4x.")
