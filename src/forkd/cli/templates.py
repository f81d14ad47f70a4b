"""``forkd template NAME``: build a ready-made template (image and warm snapshot), e.g. E2B's code interpreter."""

from __future__ import annotations

import click

from forkd.cli.common import ca_cert_options, console, daemon, json_option, print_json, progress_printer, \
    reports_errors
from forkd.sdk.templates import TEMPLATES, build_template


@click.command()
@click.argument("name", type=click.Choice(sorted(TEMPLATES)))
@ca_cert_options
@click.option("--force", is_flag=True, help="rebuild the image and bake the snapshot again")
@json_option
@reports_errors
def template(name: str, ca_certs: list[str], force: bool, as_json: bool) -> None:
    """Build template NAME: its image (cached by its inputs) and its warm snapshot, if absent.

    code-interpreter: snapshot `code-interpreter-v1`, what E2B's code-interpreter SDK starts when
    `Sandbox.create()` names no template (numpy, pandas, matplotlib, scipy, scikit-learn, seaborn,
    requests and more, imported before the save). Builds take minutes the first time.
    """
    chosen = TEMPLATES[name]
    record = build_template(daemon(), chosen, ca_certs, force=force, on_progress=progress_printer())
    if as_json:
        print_json(record)
        return
    console.print(f"template [bold]{chosen.tag}[/bold] ready (image {chosen.image}; warm: "
                  f"{', '.join(chosen.warm_modules)})")
