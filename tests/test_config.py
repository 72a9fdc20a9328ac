"""Configuration: each engine's own section, placement and Ray keys, readable errors.

Pure and fast: settings are built with ``load_settings`` and the CLI's argument
parser, no server is started.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from tokenmill.cli import build_parser, settings_from_args
from tokenmill.config import (
    DEFAULT_DEPLOYMENT_ID,
    ENGINE_SECTIONS,
    ConfigError,
    LlamaCppDeployment,
    Price,
    ReplicatedDeployment,
    ScriptedDeployment,
    Settings,
    UpstreamDeployment,
    load_settings,
    parse_section,
)

NOWHERE = "http://127.0.0.1:9/v1"


def load_toml(tmp_path: Path, text: str, environ: dict[str, str] | None = None) -> Settings:
    path = tmp_path / "tokenmill.toml"
    path.write_text(text)
    return load_settings(path, environ={} if environ is None else environ)


def config_error(tmp_path: Path, text: str) -> str:
    with pytest.raises(ConfigError) as info:
        load_toml(tmp_path, text)
    message = str(info.value)
    assert message.startswith(f"invalid configuration in {tmp_path / 'tokenmill.toml'}:")
    return message


def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in [k for k in os.environ if k.startswith("TOKENMILL_")]:
        monkeypatch.delenv(key)


def one(keys: str) -> str:
    return f'[[deployments]]\nid = "a"\n{keys}\n'


# -- sections ------------------------------------------------------------------------


def test_a_deployment_without_engine_is_llamacpp_in_a_process(tmp_path: Path) -> None:
    (dep,) = load_toml(tmp_path, one("")).deployments
    assert isinstance(dep, LlamaCppDeployment)
    assert dep.engine == "llamacpp"
    assert dep.placement == "process"
    assert dep.ray_num_cpus is None and dep.ray_resources == {}
    assert dep.ray_cpus() == 1.0
    assert not hasattr(dep, "isolated")


def test_each_engine_gets_its_own_section(tmp_path: Path) -> None:
    settings = load_toml(
        tmp_path,
        '[[deployments]]\nid = "l"\nengine = "llamacpp"\n'
        f'[[deployments]]\nid = "u"\nengine = "upstream"\nurl = "{NOWHERE}"\nn_ctx = 4096\n'
        '[[deployments]]\nid = "s"\nengine = "scripted"\ncontrol = "/tmp/x.sock"\n',
    )
    kinds = [type(d) for d in settings.deployments]
    assert kinds == [LlamaCppDeployment, UpstreamDeployment, ScriptedDeployment]
    u, s = settings.deployments[1], settings.deployments[2]
    assert isinstance(u, UpstreamDeployment) and u.n_ctx == 4096
    assert isinstance(s, ScriptedDeployment) and s.control == Path("/tmp/x.sock")
    assert s.placement == "process" and s.replica_nice == 0


def test_each_section_names_its_engine_class() -> None:
    targets = {c.engine_name(): c.ENGINE_TARGET for c in ENGINE_SECTIONS}
    assert targets == {
        "llamacpp": "tokenmill.engines.llamacpp:LlamaCppEngine",
        "upstream": "tokenmill.engines.upstream:UpstreamEngine",
        "scripted": "tokenmill.engines.scripted:ScriptedEngine",
    }
    dep = LlamaCppDeployment(id="a")
    assert dep.engine_target() == "tokenmill.engines.llamacpp:LlamaCppEngine"


def test_default_deployment_is_llamacpp() -> None:
    (dep,) = Settings().with_default_deployment().deployments
    assert isinstance(dep, LlamaCppDeployment)
    assert dep.id == DEFAULT_DEPLOYMENT_ID and dep.model is None


@pytest.mark.parametrize(
    "section",
    [
        LlamaCppDeployment(
            id="l",
            placement="ray",
            ray_num_cpus=2.5,
            ray_resources={"node_b": 1},
            n_threads=2,
            price=Price(prompt_per_mtok=3, completion_per_mtok=7),
        ),
        LlamaCppDeployment(id="l2", placement="local", idle_unload_s=60),
        UpstreamDeployment(
            id="u", url=NOWHERE, api_key="sk-x", headers={"x-team": "r"}, tokenizer="embedded"
        ),
        ScriptedDeployment(id="s", control=Path("/tmp/x.sock"), placement="ray", replicas=3),
    ],
    ids=["llamacpp-ray", "llamacpp-local", "upstream", "scripted-ray"],
)
def test_sections_round_trip_through_json(section: Any) -> None:
    data = section.model_dump(mode="json")
    again = parse_section(data)
    assert type(again) is type(section)
    assert again == section
    assert again.model_dump(mode="json") == data


def test_ray_cpus_defaults_to_the_replica_threads() -> None:
    assert LlamaCppDeployment(id="a", placement="ray", n_threads=3).ray_cpus() == 3.0
    assert LlamaCppDeployment(id="a", placement="ray", ray_num_cpus=0.5).ray_cpus() == 0.5
    assert ScriptedDeployment(id="s", control=Path("/x"), placement="ray").ray_cpus() == 1.0


# -- placement and its deprecated alias ------------------------------------------------


@pytest.mark.parametrize(
    ("isolated", "placement"), [("true", "process"), ("false", "local")], ids=["true", "false"]
)
@pytest.mark.parametrize("engine", ["llamacpp", "scripted"])
def test_isolated_is_read_as_placement(
    tmp_path: Path, engine: str, isolated: str, placement: str
) -> None:
    keys = f'engine = "{engine}"\ncontrol = "/tmp/x.sock"\n' if engine == "scripted" else ""
    (dep,) = load_toml(tmp_path, one(f"{keys}isolated = {isolated}")).deployments
    assert isinstance(dep, ReplicatedDeployment)
    assert dep.placement == placement
    assert "isolated" not in type(dep).model_fields
    assert "isolated" not in dep.model_dump()
    # Saying the same thing twice is fine.
    (same,) = load_toml(
        tmp_path, one(f'{keys}isolated = {isolated}\nplacement = "{placement}"')
    ).deployments
    assert same == dep


def test_isolated_contradicting_placement_is_an_error(tmp_path: Path) -> None:
    message = config_error(tmp_path, one('isolated = false\nplacement = "ray"'))
    assert "deployments.0: " in message
    assert "'isolated = false' (deprecated) means placement = 'local'" in message
    assert "placement = 'ray'" in message
    message = config_error(tmp_path, one('isolated = "yes"'))
    assert "'isolated' (deprecated: use placement) must be true or false" in message


def test_unknown_placement_is_an_error(tmp_path: Path) -> None:
    message = config_error(tmp_path, one('placement = "thread"'))
    assert "deployments.0.placement: Input should be 'process', 'local' or 'ray'" in message


def test_routing_is_cache_aware_unless_named(tmp_path: Path) -> None:
    (dep,) = load_toml(tmp_path, one("")).deployments
    assert dep.routing == "cache_aware"
    (dep,) = load_toml(tmp_path, one('routing = "round_robin"')).deployments
    assert dep.routing == "round_robin"
    message = config_error(tmp_path, one('routing = "random"'))
    assert (
        "deployments.0.routing: Input should be 'cache_aware', 'least_loaded' or "
        "'round_robin'" in message
    )


# -- Ray keys ----------------------------------------------------------------------------


def test_ray_keys_on_ray(tmp_path: Path) -> None:
    (dep,) = load_toml(
        tmp_path,
        one('placement = "ray"\nray_num_cpus = 2\nray_resources = { node_b = 1 }'),
    ).deployments
    assert isinstance(dep, LlamaCppDeployment)
    assert dep.ray_num_cpus == 2.0 and dep.ray_resources == {"node_b": 1.0}


@pytest.mark.parametrize(
    ("keys", "expect"),
    [
        ("ray_num_cpus = 2", "deployments.0.ray_num_cpus: 'ray_num_cpus' is only for"),
        ("ray_resources = { node_b = 1 }", "deployments.0.ray_resources: 'ray_resources' is"),
        (
            'placement = "local"\nray_num_cpus = 1',
            "(this deployment's placement is 'local')",
        ),
        (
            'engine = "scripted"\ncontrol = "/tmp/x.sock"\nray_num_cpus = 1',
            "deployments.0.ray_num_cpus: 'ray_num_cpus' is only for placement = \"ray\"",
        ),
        ('engine = "upstream"\nurl = "' + NOWHERE + '"\nray_num_cpus = 1', "not upstream"),
        ('placement = "ray"\nray_num_cpus = 0', "greater than 0"),
        ('placement = "ray"\nray_resources = { node_b = -1 }', "deployments.0.ray_resources"),
        ('placement = "ray"\nray_resources = { CPU = 2 }', "'CPU' is not a custom resource"),
    ],
    ids=[
        "cpus-off-ray",
        "resources-off-ray",
        "cpus-local",
        "scripted-off-ray",
        "upstream",
        "zero-cpus",
        "negative-resource",
        "cpu-resource",
    ],
)
def test_bad_ray_keys(tmp_path: Path, keys: str, expect: str) -> None:
    assert expect in config_error(tmp_path, one(keys))


# -- replica pools ----------------------------------------------------------------


def test_a_pool_on_ray_round_trips_and_defaults_to_none(tmp_path: Path) -> None:
    (dep,) = load_toml(tmp_path, one('placement = "ray"\npool = "smollm2-pool"')).deployments
    assert isinstance(dep, LlamaCppDeployment) and dep.pool == "smollm2-pool"
    assert parse_section(dep.model_dump(mode="json")) == dep
    scripted = 'engine = "scripted"\ncontrol = "/tmp/x.sock"\nplacement = "ray"\npool = "p"'
    (dep,) = load_toml(tmp_path, one(scripted)).deployments
    assert isinstance(dep, ScriptedDeployment) and dep.pool == "p"
    (dep,) = load_toml(tmp_path, one('placement = "ray"')).deployments
    assert isinstance(dep, LlamaCppDeployment) and dep.pool is None


@pytest.mark.parametrize(
    ("keys", "expect"),
    [
        ('pool = "p"', "deployments.0.pool: 'pool' needs placement = \"ray\" (this deployment's"),
        ('placement = "local"\npool = "p"', "placement is 'local'"),
        (
            'placement = "ray"\npool = "p"\nidle_unload_s = 60',
            "deployments.0.pool: a pool's replicas are not unloaded when idle",
        ),
        ('placement = "ray"\npool = "a/b"', "deployments.0.pool: String should match pattern"),
        ('placement = "ray"\npool = ""', "deployments.0.pool"),
        ('engine = "upstream"\nurl = "' + NOWHERE + '"\npool = "p"', "not upstream"),
    ],
    ids=["process", "local", "idle-unload", "slash", "empty", "upstream"],
)
def test_bad_pool_keys(tmp_path: Path, keys: str, expect: str) -> None:
    assert expect in config_error(tmp_path, one(keys))


def test_ray_address_from_file_environment_and_flag(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ray_dep = one('placement = "ray"')
    settings = load_toml(tmp_path, ray_dep)
    assert settings.ray_address is None
    assert settings.ray_target() == "local"  # Ray placement without an address: local
    assert load_toml(tmp_path, one("")).ray_target() is None  # no Ray at all

    in_file = 'ray_address = "ray://file:10001"\n' + ray_dep
    assert load_toml(tmp_path, in_file).ray_target() == "ray://file:10001"
    env = {"TOKENMILL_RAY_ADDRESS": "auto"}
    assert load_toml(tmp_path, in_file, env).ray_address == "auto"

    config = tmp_path / "tokenmill.toml"
    clean_environment(monkeypatch)
    monkeypatch.setenv("TOKENMILL_RAY_ADDRESS", "auto")
    args = build_parser().parse_args(["serve", "--config", str(config)])
    assert settings_from_args(args).ray_address == "auto"
    args = build_parser().parse_args(
        ["serve", "--config", str(config), "--ray-address", "ray://flag:10001"]
    )
    settings = settings_from_args(args)
    assert settings.ray_address == "ray://flag:10001"
    assert settings.ray_target() == "ray://flag:10001"


def test_cli_model_flag_builds_a_llamacpp_section(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clean_environment(monkeypatch)
    model = tmp_path / "tiny.gguf"
    model.write_bytes(b"GGUF")
    (dep,) = settings_from_args(
        build_parser().parse_args(["serve", "--model", str(model)])
    ).deployments
    assert isinstance(dep, LlamaCppDeployment)
    assert dep.id == "tiny" and dep.model == model and dep.placement == "process"


def test_the_kv_layout_is_shared_at_the_models_context_unless_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clean_environment(monkeypatch)
    (dep,) = settings_from_args(build_parser().parse_args(["serve"])).deployments
    assert isinstance(dep, LlamaCppDeployment)
    assert dep.kv_layout == "shared" and dep.n_ctx == 0 and dep.kv_pool_tokens is None
    args = build_parser().parse_args(["serve", "--kv-layout", "per_slot", "--n-ctx", "4096"])
    (dep,) = settings_from_args(args).deployments
    assert isinstance(dep, LlamaCppDeployment)
    assert dep.kv_layout == "per_slot" and dep.n_ctx == 4096


# -- error messages ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("keys", "expect"),
    [
        ('model = "missing.gguf"', "deployments.0.model: model file not found"),
        ("replicas = 0", "deployments.0.replicas: Input should be greater than or equal to 1"),
        ('colour = "blue"', "deployments.0.colour: unknown key"),
        (
            'engine = "upstream"\nurl = "' + NOWHERE + '"\ncolour = "blue"',
            "deployments.0.colour: unknown key",
        ),
        (
            'engine = "scripted"\ncontrol = "/x"\ncolour = "blue"',
            "deployments.0.colour: unknown key",
        ),
        ("price = { prompt_per_mtok = -1 }", "deployments.0.price.prompt_per_mtok: "),
        ("batch_discount = 1", "deployments.0.batch_discount: Input should be less than 1"),
        ("batch_share = 0", "deployments.0.batch_share: Input should be greater than 0"),
        (
            "autoscale = { min_replicas = 3, max_replicas = 2 }",
            "deployments.0.autoscale: min_replicas = 3 is more than max_replicas = 2",
        ),
        (
            "autoscale = { max_replicas = 2, target_ongoing_requests = 0 }",
            "deployments.0.autoscale.target_ongoing_requests: Input should be greater than 0",
        ),
        (
            "autoscale = { max_replicas = 2, target_ttft_p90_s = 0 }",
            "deployments.0.autoscale.target_ttft_p90_s: Input should be greater than 0",
        ),
        ("autoscale = { min_replicas = 1 }", "deployments.0.autoscale.max_replicas: "),
        (
            "replicas = 3\nautoscale = { max_replicas = 2 }",
            "deployments.0.autoscale: replicas = 3 (the count autoscale starts "
            "with) is outside min_replicas..max_replicas (1..2)",
        ),
        (
            "idle_unload_s = 60\nautoscale = { max_replicas = 2 }",
            "deployments.0.autoscale: autoscale replaces idle_unload_s",
        ),
        (
            'placement = "local"\nautoscale = { max_replicas = 2 }',
            "deployments.0.autoscale: autoscale needs replicas of their own",
        ),
        (
            'placement = "ray"\npool = "p"\nautoscale = { min_replicas = 0, max_replicas = 2 }',
            "deployments.0.autoscale: a pool's replicas are shared by gateways and never all "
            "stopped: min_replicas must be at least 1 with a pool",
        ),
        (
            "autoscale = { max_replicas = 2, colour = 1 }",
            "deployments.0.autoscale.colour: unknown key",
        ),
    ],
    ids=[
        "model",
        "replicas",
        "unknown-llamacpp",
        "unknown-upstream",
        "unknown-scripted",
        "price",
        "batch-discount",
        "batch-share",
        "autoscale-bounds",
        "autoscale-target-zero",
        "autoscale-ttft-zero",
        "autoscale-no-max",
        "autoscale-start-outside",
        "autoscale-idle-unload",
        "autoscale-local",
        "autoscale-pool",
        "autoscale-unknown",
    ],
)
def test_error_locations_leave_out_the_engine_tag(tmp_path: Path, keys: str, expect: str) -> None:
    message = config_error(tmp_path, one(keys))
    assert expect in message
    for tag in ("llamacpp", "upstream", "scripted"):
        assert f".{tag}." not in message and f"0.{tag}:" not in message


@pytest.mark.parametrize(
    ("keys", "expect"),
    [
        ('tokenizer = "embedded"', "'tokenizer' is for upstream deployments"),
        ('control = "/tmp/x.sock"', "'control' is only for scripted (test) deployments"),
        (
            f'url = "{NOWHERE}"',
            "deployments.0.url: 'url' is for upstream deployments, not llamacpp",
        ),
        (
            'engine = "upstream"\nurl = "' + NOWHERE + '"\nreplicas = 2',
            "deployments.0.replicas: 'replicas' is for llamacpp and scripted deployments, "
            "not upstream",
        ),
        (
            'engine = "upstream"\nurl = "' + NOWHERE + '"\nisolated = false',
            "deployments.0.isolated: 'isolated' is for llamacpp and scripted deployments",
        ),
        (
            'engine = "upstream"\nurl = "' + NOWHERE + '"\nautoscale = { max_replicas = 2 }',
            "deployments.0.autoscale: 'autoscale' is for llamacpp and scripted deployments, "
            "not upstream",
        ),
        (
            'engine = "scripted"\ncontrol = "/x"\nmodel = "m.gguf"',
            "deployments.0.model: 'model' is for llamacpp deployments, not scripted",
        ),
    ],
    ids=[
        "tokenizer-on-llamacpp",
        "control-on-llamacpp",
        "url-on-llamacpp",
        "replicas-on-upstream",
        "isolated-on-upstream",
        "autoscale-on-upstream",
        "model-on-scripted",
    ],
)
def test_another_engines_key_is_named(tmp_path: Path, keys: str, expect: str) -> None:
    message = config_error(tmp_path, one(keys))
    assert "deployments.0" in message
    assert expect in message


@pytest.mark.parametrize(
    ("keys", "expect"),
    [
        ('engine = "scripted"', "deployments.0.control: a scripted (test) deployment needs"),
        ('engine = "upstream"', "deployments.0.url: an upstream deployment needs 'url'"),
        (
            'engine = "upstream"\nurl = "http://127.0.0.1:9"',
            "deployments.0.url: 'url' must be an OpenAI-compatible base URL ending in /v1",
        ),
        (
            'engine = "upstream"\nurl = "' + NOWHERE + '"\ntokenizer = "nope.gguf"',
            "deployments.0.tokenizer: tokenizer file not found",
        ),
        ('[[deployments]]\nid = "a"', "duplicate deployment id 'a'"),
        (
            'kv_layout = "per_slot"\nkv_pool_tokens = 4096',
            "kv_pool_tokens sizes the shared pool; with kv_layout = 'per_slot'",
        ),
        ('kv_layout = "paged"', "deployments.0.kv_layout: Input should be 'shared' or 'per_slot'"),
    ],
    ids=[
        "no-control",
        "no-url",
        "bad-url",
        "missing-tokenizer",
        "duplicate-id",
        "pool-per-slot",
        "bad-layout",
    ],
)
def test_engine_specific_errors(tmp_path: Path, keys: str, expect: str) -> None:
    assert expect in config_error(tmp_path, one(keys))


def test_unknown_engine_is_readable(tmp_path: Path) -> None:
    message = config_error(tmp_path, one('engine = "vllm"'))
    assert (
        "deployments.0.engine: unknown engine 'vllm' (one of 'llamacpp', 'upstream', 'scripted')"
        in message
    )
    assert "Input tag" not in message


def test_a_deployment_that_is_not_a_table(tmp_path: Path) -> None:
    message = config_error(tmp_path, 'deployments = ["a"]\n')
    assert "deployments.0: Input should be a valid dictionary" in message


def test_stream_keepalive_from_file_and_environment(tmp_path: Path) -> None:
    assert load_toml(tmp_path, one("")).stream_keepalive_s == 5.0  # on by default
    assert load_toml(tmp_path, "stream_keepalive_s = 15\n" + one("")).stream_keepalive_s == 15
    env = {"TOKENMILL_STREAM_KEEPALIVE_S": "0"}  # off
    assert load_toml(tmp_path, "stream_keepalive_s = 15\n" + one(""), env).stream_keepalive_s == 0
    message = config_error(tmp_path, "stream_keepalive_s = -1\n" + one(""))
    assert "stream_keepalive_s: Input should be greater than or equal to 0" in message
