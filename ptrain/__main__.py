"""`python -m ptrain` and the `ptrain` console script: the Hydra entry point."""


def main() -> None:
    # Before anything heavy is imported: this may restart the process with glibc's
    # huge-page malloc tunable (ptrain/runtime.py says why).
    from ptrain.runtime import reexec_with_malloc_tuning

    reexec_with_malloc_tuning()
    from ptrain.cli import main as cli_main

    cli_main()


if __name__ == "__main__":
    main()
