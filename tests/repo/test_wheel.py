"""A built wheel carries everything the CLI needs: the recipes (trl_rollout_corr/recipes is a link to the top-level
recipes/: the wheel must hold the files, not the link), the console script, and metadata without placeholders.

The wheel is built from a copy of the checkout's files (tracked and untracked, not ignored) with the environment's
setuptools (``pip wheel --no-deps --no-build-isolation``: nothing downloaded), unpacked, and its CLI run from the
unpacked files in a directory outside the checkout. CI (.ci/run) also installs it into a fresh venv with the CPU torch.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _copy_checkout(dest: str) -> None:
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True,
                           check=True).stdout.decode().split("\0")
    for rel in filter(None, files):
        src, dst = os.path.join(ROOT, rel), os.path.join(dest, rel)
        if not os.path.lexists(src):  # deleted in the work tree, not yet committed
            continue
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        if os.path.islink(src):
            os.symlink(os.readlink(src), dst)  # the recipes link stays a link, as in a clone
        else:
            shutil.copy2(src, dst)


def test_a_built_wheel_carries_the_recipes_and_runs_its_cli(tmp_path):
    src, out, unpacked, elsewhere = (tmp_path / name for name in ("src", "dist", "unpacked", "elsewhere"))
    _copy_checkout(str(src))
    assert os.path.islink(src / "trl_rollout_corr" / "recipes")
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(src),
                            "-w", str(out)], capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stderr[-3000:]
    (wheel,) = glob.glob(str(out / "trl_rollout_corr-*.whl"))
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        zf.extractall(unpacked)
        metadata = zf.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
        entry_points = zf.read(next(n for n in names if n.endswith(".dist-info/entry_points.txt"))).decode()
    recipes = sorted(os.path.relpath(p, os.path.join(ROOT, "recipes"))
                     for p in glob.glob(os.path.join(ROOT, "recipes", "**", "*.*"), recursive=True))
    assert len(recipes) >= 17 and "trl_default.yaml" in recipes
    missing = [r for r in recipes if f"trl_rollout_corr/recipes/{r}" not in names]
    assert not missing, f"the wheel lacks recipes {missing}: check [tool.setuptools.package-data]"
    assert "trl-rollout-corr = trl_rollout_corr.cli.main:main" in entry_points
    assert "no public repository" not in metadata
    assert "Project-URL: Documentation" in metadata and "Project-URL: Changelog" in metadata
    # the CLI from the wheel's files only (the environment supplies the dependencies), outside any checkout
    elsewhere.mkdir()
    env = {**os.environ, "PYTHONPATH": str(unpacked)}
    code = ("import sys, trl_rollout_corr; from trl_rollout_corr.cli.main import main; "
            f"assert trl_rollout_corr.__file__.startswith({str(unpacked)!r}), trl_rollout_corr.__file__; "
            "main(sys.argv[1:])")
    for args, expect in ((["--help"], "trl-rollout-corr recipes DIR"), (["recipes", str(elsewhere / "recipes")],
                                                                          "wrote ")):
        res = subprocess.run([sys.executable, "-c", code, *args], cwd=elsewhere, env=env, capture_output=True,
                             text=True, timeout=300)
        assert res.returncode == 0 and expect in res.stdout, (res.stdout[-2000:], res.stderr[-3000:])
    written = sorted(os.path.relpath(p, elsewhere / "recipes")
                     for p in glob.glob(str(elsewhere / "recipes" / "**" / "*.*"), recursive=True))
    assert written == recipes
