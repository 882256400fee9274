"""`k3build` command line: synth, convert, plan, build, inspect.

Each subcommand lives beside the code it drives; this file only gathers them. Errors the user can fix are
`click.ClickException`s (message + exit code 1), never tracebacks.
"""

import click


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="k3build")
def main():
    """Offline converter and engine builder for Kimi-K3."""


def _register():
    # Subcommands are imported lazily so `k3build --help` stays fast and one broken room cannot hide the others.
    import importlib

    for module, attr in COMMANDS:
        try:
            main.add_command(getattr(importlib.import_module(module), attr))
        except ModuleNotFoundError as e:
            if not e.name or not e.name.startswith("k3build"):
                raise


# (module, click command attribute); a helper adds its line here.
COMMANDS = [
    ("k3build.synth", "synth_cmd"),
    ("k3build.convert", "convert_cmd"),
    ("k3build.plan", "plan_cmd"),
    ("k3build.build.cli", "build_cmd"),
    ("k3build.build.cli", "inspect_cmd"),
]

_register()


if __name__ == "__main__":
    main()
