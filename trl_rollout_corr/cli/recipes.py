"""``trl-rollout-corr recipes DIR``: write the recipes shipped with the package to DIR, usable from any directory.

The recipes (training YAMLs per preset, the CPU demo's, accelerate configs for DDP, DeepSpeed ZeRO-2/3 and FSDP2) live
in the repository's ``recipes/`` and ship inside the package (``trl_rollout_corr/recipes``). Their paths are written
relative to a checkout's root (``recipes/accelerate/ds_zero3.json``, which accelerate resolves against the working
directory); written out, every such path becomes DIR's absolute one, so the files work wherever they are launched from.
"""

from __future__ import annotations

import argparse
from importlib.resources import files
from pathlib import Path

REPO_PREFIX = "recipes/"  # how the shipped files name each other (relative to a checkout's root)


def shipped_recipes() -> dict[str, str]:
    """Relative path (``accelerate/ds_zero3.json``) -> text of every recipe shipped with the package."""
    root = files("trl_rollout_corr") / "recipes"
    found: dict[str, str] = {}

    def walk(node, prefix: str) -> None:
        for child in node.iterdir():
            if child.is_dir():
                walk(child, f"{prefix}{child.name}/")
            elif child.name.endswith((".yaml", ".json")):
                found[f"{prefix}{child.name}"] = child.read_text()

    if not root.is_dir():
        raise FileNotFoundError("the recipes are not installed with this copy of trl_rollout_corr "
                                "(trl_rollout_corr/recipes is missing): reinstall it from a clone, `pip install -e .`")
    walk(root, "")
    return found


def write_recipes(out_dir: str | Path, force: bool = False) -> list[Path]:
    """Write every shipped recipe under ``out_dir``, its ``recipes/...`` paths made absolute; return the files.

    An existing file is an error naming it (``force=True`` overwrites)."""
    out = Path(out_dir).resolve()
    recipes = shipped_recipes()
    clashes = [out / name for name in recipes if (out / name).exists()]
    if clashes and not force:
        raise FileExistsError(f"{clashes[0]} exists ({len(clashes)} recipe files would be overwritten): choose an "
                              "empty directory or pass --force")
    written = []
    for name, text in sorted(recipes.items()):
        path = out / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text.replace(REPO_PREFIX, f"{out}/"))
        written.append(path)
    return written


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="trl-rollout-corr recipes", description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", help="where to write the recipes (created if missing)")
    parser.add_argument("--force", action="store_true", help="overwrite recipe files already there")
    opts = parser.parse_args(argv)
    written = write_recipes(opts.out_dir, force=opts.force)
    out = Path(opts.out_dir).resolve()
    print(f"wrote {len(written)} recipes to {out}:")
    for path in written:
        print(f"  {path.relative_to(out)}")
    print(f"e.g. trl-rollout-corr train --config {out}/ppo_is_bypass.yaml --model_name_or_path ...\n"
          f"     accelerate launch --config_file {out}/accelerate/deepspeed_zero3.yaml -m trl_rollout_corr train ...")
