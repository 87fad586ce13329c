"""The repository names no file of a particular machine: no home or workspace directory, and no team notes that live
outside it. What such notes said belongs in docs/ (docs/testing.md holds the measured XLA:CPU facts)."""

import os
import re
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Built from parts so that this file does not match itself.
MACHINE_PATHS = re.compile("|".join([
    r"/" + r"home/[A-Za-z_][\w.-]*/",          # a user's home directory
    r"/" + r"Users/[A-Za-z_][\w.-]*/",         # the same on macOS
    r"/" + r"root/",                            # root's home
    r"(?<![\w.-])/" + r"work/",                 # the development machines' workspace
    r"\.\./" + r"shared\b",                     # team notes beside the repository
    r"\b(?:DESIGN|XLA_TESTING)" + r"\.md\b",   # those notes by name
]))


def _tracked_files():
    try:
        listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
        return [name for name in listed.decode().split("\0") if name]
    except (OSError, subprocess.CalledProcessError):  # an exported tree without git: walk it
        found = []
        for directory, subdirectories, files in os.walk(ROOT):
            subdirectories[:] = [d for d in subdirectories if not d.startswith(".") and not d.endswith(".egg-info")]
            found += [os.path.relpath(os.path.join(directory, f), ROOT) for f in files]
        return found


def test_no_file_names_a_path_of_a_particular_machine():
    offenders = []
    for name in _tracked_files():
        if name == os.path.relpath(__file__, ROOT):
            continue
        try:
            with open(os.path.join(ROOT, name), encoding="utf-8") as f:
                text = f.read()
        except (UnicodeDecodeError, FileNotFoundError):
            continue
        for number, line in enumerate(text.splitlines(), 1):
            match = MACHINE_PATHS.search(line)
            if match:
                offenders.append(f"{name}:{number}: {match.group(0)!r} in {line.strip()[:100]!r}")
    assert not offenders, "paths of a particular machine (move what they point to into docs/):\n" + "\n".join(offenders)
