"""``forkd template NAME``: build a ready-made template (image and warm snapshot), e.g. E2B's code interpreter."""

from __future__ import annotations

from typing import TextIO

import click

from forkd.cli.common import HOST_CA_DIR, console, daemon, json_option, print_json, progress_printer, \
    read_host_ca_certs, reports_errors
from forkd.sdk.templates import TEMPLATES, build_template


@click.command()
@click.argument("name", type=click.Choice(sorted(TEMPLATES)))
@click.option("--ca-cert", "ca_cert_files", multiple=True, type=click.File("r"),
              help="PEM CA certificate to add to the guest's trust store (repeatable)")
@click.option("--host-ca-certs", is_flag=True,
              help=f"add the CA certificates this host trusts locally ({HOST_CA_DIR}/*.crt), e.g. a TLS proxy's")
@click.option("--force", is_flag=True, help="rebuild the image and bake the snapshot again")
@json_option
@reports_errors
def template(name: str, ca_cert_files: tuple[TextIO, ...], host_ca_certs: bool, force: bool, as_json: bool) -> None:
    """Build template NAME: its image (cached by its inputs) and its warm snapshot, if absent.

    code-interpreter: snapshot `code-interpreter-v1`, what E2B's code-interpreter SDK starts when
    `Sandbox.create()` names no template (numpy, pandas, matplotlib, scipy, scikit-learn, seaborn,
    requests and more, imported before the save). Builds take minutes the first time.
    """
    chosen = TEMPLATES[name]
    ca_certs = [f.read() for f in ca_cert_files] + (read_host_ca_certs() if host_ca_certs else [])
    record = build_template(daemon(), chosen, ca_certs, force=force, on_progress=progress_printer())
    if as_json:
        print_json(record)
        return
    console.print(f"template [bold]{chosen.tag}[/bold] ready (image {chosen.image}; warm: "
                  f"{', '.join(chosen.warm_modules)})")
