from pathlib import Path

import pytest

from forkd.daemon.config import ConfigError, load_config
from forkd.vmm.backends import UnknownBackend, create_vmm


def test_precedence_is_flags_then_environment_then_file(tmp_path: Path) -> None:
    file = tmp_path / "forkd.toml"
    file.write_text('home = "/from/file"\ncache = "/cache/file"\n[limits]\nmax_sandboxes = 3\n'
                    '[sandboxes]\nkeep_on_stop = true\n')
    config = load_config(file, env={"FORKD_CACHE": "/cache/env"}, overrides={"limits.max_concurrent_forks": 2,
                                                                            "home": None})
    assert (config.home, config.cache) == (Path("/from/file"), Path("/cache/env"))
    assert config.paths.socket == Path("/from/file/forkd.sock")
    options = config.runtime_options
    assert (options.max_sandboxes, options.max_concurrent_forks, options.keep_sandboxes_on_stop) == (3, 2, True)
    assert load_config(file, env={"FORKD_HOME": "/env"}, overrides={"home": "/flag"}).home == Path("/flag")


@pytest.mark.parametrize(("text", "names"), [
    ("hom = '/x'\n", "hom"),
    ("[limits]\nmax_sandboxes = 0\n", "limits.max_sandboxes"),
    ("accelerator = 'hvf'\n", "accelerator"),
    ("vmm = 'firecracker'\n", "vmm: Value error, unknown VMM backend 'firecracker'; the known backends are fake, qemu"),
    ("listen = 'no port'\n", "listen"),
    ("tls_cert = '/c'\n", "tls_key"),
    ("home = [\n", "not valid TOML"),
])
def test_bad_files_are_refused_naming_the_key(tmp_path: Path, text: str, names: str) -> None:
    file = tmp_path / "forkd.toml"
    file.write_text(text)
    with pytest.raises(ConfigError) as refused:
        load_config(file, env={})
    assert names in str(refused.value) and str(file) in str(refused.value)


def test_a_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path / "absent.toml", env={})


def test_runtime_keys_come_from_the_file_or_their_old_variables(tmp_path: Path) -> None:
    file = tmp_path / "forkd.toml"
    file.write_text('[network]\npool = "10.99.0.0/16"\n[limits]\nmax_branches = 4\n'
                    '[output]\nresult_bytes = 65536\nstream_buffer_bytes = 8192\n')
    options = load_config(file, env={}).runtime_options
    assert (options.net_pool, options.max_concurrent_branches, options.dns) == ("10.99.0.0/16", 4, None)
    assert (options.output.result_bytes, options.output.stream_buffer_bytes, options.output.stream_bytes) == \
        (65536, 8192, None)
    env = {"FORKD_DNS": "192.168.250.2", "FORKD_MAX_BRANCHES": "3", "FORKD_NET_POOL": "10.98.0.0/16"}
    options = load_config(file, env=env).runtime_options
    assert (options.dns, options.max_concurrent_branches, options.net_pool) == ("192.168.250.2", 3, "10.98.0.0/16")


@pytest.mark.parametrize(("env", "names"), [
    ({"FORKD_DNS": "not-an-address"}, "network.dns"),
    ({"FORKD_NET_POOL": "8.8.8.0/24"}, "not a private range"),
    ({"FORKD_MAX_BRANCHES": "0"}, "limits.max_branches"),
])
def test_bad_runtime_values_are_refused_naming_the_key(env: dict[str, str], names: str) -> None:
    with pytest.raises(ConfigError) as refused:
        load_config(None, env=env)
    assert names in str(refused.value)


def test_limits_have_real_defaults_as_documented() -> None:
    options = load_config(env={}).runtime_options
    assert options.max_sandboxes == 500
    assert options.max_concurrent_forks is None and options.restore_slots() >= 2  # 2 per host CPU


def test_the_backend_is_chosen_by_name_through_the_registry(tmp_path: Path) -> None:
    file = tmp_path / "forkd.toml"
    file.write_text('vmm = "qemu"\naccelerator = "tcg"\n')
    assert load_config(env={}).vmm == "qemu"  # the default
    assert load_config(file, env={"FORKD_VMM": "fake"}).vmm == "fake"
    assert load_config(file, env={"FORKD_VMM": "fake"}, overrides={"vmm": "qemu"}).vmm == "qemu"
    config = load_config(file, env={"FORKD_VMM": "fake"})
    vmm = create_vmm(config.vmm, config.backend_options)
    assert vmm.capabilities().kind == "fake" and vmm.disk.file_name == "disk.fake"
    qemu = create_vmm("qemu", load_config(file, env={}).backend_options)
    assert qemu.disk.file_name == "disk.qcow2"  # the name every QEMU snapshot on disk and in a pack has
    with pytest.raises(UnknownBackend, match="unknown VMM backend 'kvmtool'; the known backends are fake, qemu"):
        create_vmm("kvmtool")


def test_confinement_keys_reach_the_backend_and_a_bad_uid_range_is_named(tmp_path: Path) -> None:
    file = tmp_path / "forkd.toml"
    file.write_text('[confinement]\nuid_range = "200000-200009"\nmax_open_files = 512\n')
    jail = load_config(file, env={}).backend_options.confinement
    assert (jail.enabled, jail.uid_range, jail.max_open_files) == (True, "200000-200009", 512)
    assert load_config(env={}).backend_options.confinement.uid_range == "1900000000-1900065535"
    file.write_text('[confinement]\nuid_range = "0-99"\n')
    with pytest.raises(ConfigError, match=r"confinement.uid_range: .*uid range '0-99' must satisfy 0 < FIRST"):
        load_config(file, env={})
    file.write_text('[confinement]\nenabled = false\n')
    assert load_config(file, env={}).backend_options.confinement.enabled is False
