"""``forkd daemon``: run the daemon in the foreground, configured by file, environment and flags."""

from __future__ import annotations

from pathlib import Path

import click

from forkd.cli.serverside import server_side


@click.command("daemon")
@click.option("--config", "config_file", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              envvar="FORKD_CONFIG", help="TOML config file, default /etc/forkd/forkd.toml when it exists "
                                          "(flags and FORKD_* variables override it) [FORKD_CONFIG]")
@click.option("--check-config", is_flag=True,
              help="check the configuration (file, environment, flags, listeners' files), print it, and exit")
@click.option("--home", type=click.Path(file_okay=False, path_type=Path), help="state directory [FORKD_HOME]")
@click.option("--cache", type=click.Path(file_okay=False, path_type=Path), help="image cache [FORKD_CACHE]")
@click.option("--socket", type=click.Path(dir_okay=False, path_type=Path), help="Unix socket [FORKD_SOCKET]")
@click.option("--listen", metavar="HOST:PORT", help="also serve on TCP, bearer token required [FORKD_LISTEN]")
@click.option("--token-file", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="file holding the token TCP clients must send (default: $FORKD_TOKEN)")
@click.option("--tls-cert", type=click.Path(exists=True, dir_okay=False, path_type=Path), help="PEM certificate")
@click.option("--tls-key", type=click.Path(exists=True, dir_okay=False, path_type=Path), help="PEM private key")
@click.option("--log-file", type=click.Path(dir_okay=False, path_type=Path), help="rotated log file (default stderr)")
@click.option("--vmm", metavar="NAME", help="VMM backend: qemu (default), or fake (no VMs, for tests) [FORKD_VMM]")
@click.option("--accel", type=click.Choice(["auto", "kvm", "tcg"]), help="accelerator (default auto)")
@click.option("--max-sandboxes", type=click.IntRange(min=1), help="limit on live + starting sandboxes")
@click.option("--max-concurrent-forks", type=click.IntRange(min=1), help="restores running at once")
@click.option("--e2b-listen", metavar="HOST:PORT", help="serve E2B's API for its SDKs here [FORKD_E2B_LISTEN]")
@click.option("--e2b-keys-file", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="E2B API keys accepted there (default: HOME/e2b/api-keys, made on first start)")
@click.option("--keep-sandboxes-on-stop/--kill-sandboxes-on-stop", default=None,
              help="leave VMMs running on stop for the next daemon to re-adopt (default: kill them)")
def daemon_command(config_file: Path | None, check_config: bool, home: Path | None, cache: Path | None, socket: Path | None,
                   listen: str | None, token_file: Path | None, tls_cert: Path | None, tls_key: Path | None,
                   log_file: Path | None, vmm: str | None, accel: str | None, max_sandboxes: int | None,
                   max_concurrent_forks: int | None, e2b_listen: str | None, e2b_keys_file: Path | None,
                   keep_sandboxes_on_stop: bool | None) -> None:
    """Run the daemon in the foreground (the CLI starts one in the background when needed).

    It always serves its 0600 Unix socket; with --listen also TCP, where every route but /healthz
    needs `Authorization: Bearer <token>`. With --e2b-listen it also serves E2B's API, so E2B's
    own SDKs drive it (see docs/e2b.md).
    """
    from forkd.config import config_file as default_config_file
    with server_side("`forkd daemon`"):
        from forkd.daemon.config import ConfigError, load_config
        from forkd.daemon.lock import DaemonAlreadyRunning
        from forkd.daemon.server import TcpListener, run
        from forkd.listeners import ListenerError
    config_file = config_file or default_config_file()  # the file clients read too (forkd/config.py)
    try:
        config = load_config(config_file, overrides={
            "home": home, "cache": cache, "socket": socket, "log_file": log_file, "vmm": vmm, "accelerator": accel,
            "listen": listen, "token_file": token_file, "tls_cert": tls_cert, "tls_key": tls_key,
            "limits.max_sandboxes": max_sandboxes, "limits.max_concurrent_forks": max_concurrent_forks,
            "sandboxes.keep_on_stop": keep_sandboxes_on_stop, "e2b.listen": e2b_listen,
            "e2b.keys_file": e2b_keys_file,
        })
        if check_config:
            TcpListener.from_config(config)  # the token file and TLS pair load
            click.echo(f"config ok ({config_file or 'no config file'}): home {config.paths.home}, "
                       f"socket {config.paths.socket}, vmm {config.vmm}, "
                       f"log {config.log_file or 'stderr'} ({config.log_format})")
            return
        run(config)
    except (ConfigError, DaemonAlreadyRunning, ListenerError) as exc:
        raise click.ClickException(str(exc)) from None
