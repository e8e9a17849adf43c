"""``flashfix`` command line: ``doctor`` and ``verify``."""

import argparse
import sys


def main(argv=None):
    import flashfix

    parser = argparse.ArgumentParser(prog="flashfix", description="Backported FlashInfer-backend fixes for vLLM and SGLang.")
    parser.add_argument("--version", action="version", version="flashfix %s" % flashfix.__version__)
    sub = parser.add_subparsers(dest="command", required=True)
    doctor = sub.add_parser("doctor", help="say, without importing any engine, what flashfix would do in this environment")
    doctor.add_argument("--json", action="store_true", help="print a JSON list, one object per patch")
    doctor.add_argument("--strict", action="store_true", help="exit 1 when an affected engine has an unknown shape")
    verify = sub.add_parser("verify", help="on this GPU: check that the fixes are in force and numerically right "
                                           "(exit 0 pass, 1 fail, 3 no GPU, 4 no engine)")
    verify.add_argument("--json", action="store_true", help="print a JSON report on stdout (progress goes to stderr)")
    args = parser.parse_args(argv)
    if args.command == "doctor":
        from flashfix._doctor import run

        return run(as_json=args.json, strict=args.strict)
    if args.command == "verify":
        from flashfix._verify import run

        return run(as_json=args.json)
    return 2


if __name__ == "__main__":
    sys.exit(main())
