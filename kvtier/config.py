"""YAML → validated configuration → cache parts. Every error names the key path and the bad value.

Validation happens entirely at load time (docs/architecture.md#config-errors): a config that loads
builds; nothing half-starts. The README's "Configuration reference" documents every key defined here.

One module because it is the one place settings are validated: the per-tier sections, the
cross-key checks (placement against tiers, groups against the model) and the builders that turn a
validated config into tiers and a residency read one schema; tiers receive validated values and never
import this module.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from kvtier.blocks import KVCacheSpec, KVGroup, resolve_block_size_factor
from kvtier.errors import KVTierConfigError, LayoutMismatch, TierUnavailable
from kvtier.hashing import Namespace

if TYPE_CHECKING:  # torch is imported only when a cache is built, never to validate a config
    from kvtier.layout import BlockLayout
from kvtier.geometry import BlockGeometry, canonical_dtype
from kvtier.tiers.redis.breaker import CircuitBreakerConfig

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
          "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: int | str) -> int:
    """``"8GiB"``, ``"512 MB"``, ``1048576`` → bytes. Raises ValueError with the accepted units."""
    if isinstance(value, bool):
        raise ValueError(f"expected a size like '8GiB' or a number of bytes, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"size must not be negative, got {value}")
        return value
    match = _SIZE.match(str(value))
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"expected a size like '8GiB', '512MB' or a number of bytes, got {value!r} "
                         f"(units: B, KB, KiB, MB, MiB, GB, GiB, TB, TiB)")
    number, unit = float(match.group(1)), _UNITS[match.group(2).lower()]
    if unit == 1 and not number.is_integer():
        raise ValueError(f"a size in bytes must be a whole number, got {value!r}")
    return int(number * unit)


Size = Annotated[int, Field(ge=0)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class _SizeMixin(_Strict):
    @field_validator("capacity", mode="before", check_fields=False)
    @classmethod
    def _size(cls, value: Any) -> int:
        size = parse_size(value)
        if size == 0:
            raise ValueError("a tier of 0 bytes stores nothing; "
                             "give it room for at least one block, or remove it")
        return size


class ModelConfig(_Strict):
    """The model whose KV cache is stored; all of it goes into the namespace fingerprint."""

    name: str = Field(min_length=1)
    num_layers: int = Field(gt=0)
    num_kv_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    dtype: str = "float16"
    mla: bool = False
    token_layout: Literal["NHD", "HND"] = "NHD"
    tp_rank: int = Field(default=0, ge=0)
    tp_size: int = Field(default=1, gt=0)

    @field_validator("dtype")
    @classmethod
    def _dtype(cls, value: str) -> str:
        try:
            return canonical_dtype(value)
        except LayoutMismatch as exc:
            raise ValueError(str(exc)) from None

    @model_validator(mode="after")
    def _rank(self) -> ModelConfig:
        if self.tp_rank >= self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} must be smaller than tp_size {self.tp_size}")
        return self


class GroupConfig(_Strict):
    """One KV-cache group. Shape keys default to the model's."""

    block_size: int = Field(gt=0, description="GPU block size of the group, in tokens")
    name: str = "full_attention"
    num_layers: int | None = Field(default=None, gt=0)
    num_kv_heads: int | None = Field(default=None, gt=0)
    head_dim: int | None = Field(default=None, gt=0)


class TierBase(_SizeMixin):
    name: str | None = None
    capacity: Size
    eviction: str = "default"
    admission: Literal["always", "second_sighting", "tinylfu"] = "always"

    @field_validator("eviction")
    @classmethod
    def _eviction(cls, value: str) -> str:
        from kvtier.policy import EVICTION_POLICIES

        if value != "default" and value not in EVICTION_POLICIES:
            raise ValueError(f"unknown eviction policy {value!r}; known: {sorted(EVICTION_POLICIES)}")
        return value


class CpuTierConfig(TierBase):
    type: Literal["cpu"]
    pinned: bool | Literal["auto"] = "auto"
    #: threads a copy of a MiB or more is split over; ``auto``: two where two CPUs are usable
    copy_threads: int | Literal["auto"] = "auto"
    #: copies into the slab with streaming (non-temporal) stores where the run-time-built helper loads
    streaming_stores: bool = True

    @field_validator("copy_threads", mode="before")
    @classmethod
    def _copy_threads(cls, value: Any) -> Any:
        if isinstance(value, bool) or (isinstance(value, int) and not 1 <= value <= 64):
            raise ValueError(f"copy_threads must be 1 to 64 or 'auto', got {value}")
        return value


class TransferConfig(_Strict):
    """Kernel or copy engine for GPU transfers (:class:`kvtier.tiers.gpu.TransferChoice`).

    ``auto`` sends pieces smaller than ``crossover`` through the batched kernel and larger ones
    through the copy engine; ``benchmarks/bench_gpu.py`` measures the crossover of a machine (1 MiB on
    an H200: ``kvtier.tiers.gpu.DEFAULT_CROSSOVER_BYTES``, which this must equal; config stays torch-free).
    """

    method: Literal["auto", "kernel", "copy_engine"] = "auto"
    crossover: Size = 1024 * 1024

    @field_validator("crossover", mode="before")
    @classmethod
    def _size(cls, value: Any) -> int:
        return parse_size(value)


class GpuTierConfig(TierBase):
    """Device memory on one CUDA device (needs CUDA and CuPy when the cache is built)."""

    type: Literal["gpu"]
    device: int = Field(default=0, ge=0)
    transfer: TransferConfig = TransferConfig()


class FileTierConfig(TierBase):
    """``path`` may name environment variables as ``${NAME}`` or ``$NAME`` and start with ``~``."""

    type: Literal["file"]
    path: str = Field(min_length=1)
    compression: Literal["none", "lz4"] = "none"
    #: the older switch: ``true`` is ``write_io: direct``, ``false`` is ``write_io: buffered``
    direct_io: bool | None = None
    #: ``None``: the file tier's default (docs/file-tier.md), or what ``direct_io`` says
    write_io: Literal["direct", "synced", "buffered"] | None = None
    io_threads: int = Field(default=4, gt=0, le=256)
    fsync: bool = False

    @field_validator("write_io")
    @classmethod
    def _write_io(cls, value: str | None, info: ValidationInfo) -> str | None:
        direct_io = info.data.get("direct_io")
        if value is not None and direct_io is not None and direct_io != (value == "direct"):
            raise ValueError(f"write_io: {value} contradicts direct_io: {str(direct_io).lower()}; "
                             f"set only write_io (direct_io is the older form of it)")
        return value

    @field_validator("path")
    @classmethod
    def _path(cls, value: str) -> str:
        return os.path.expanduser(expand_path_env(value))


_ENV_REFERENCE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
#: Keys whose values are never shown in an error message (nor in the config's repr).
_SECRET_KEYS = ("password", "url")


def redact_url(url: str) -> str:
    """Hide a password in ``redis://user:password@host``."""
    if "@" in url and "://" in url:
        scheme, rest = url.split("://", 1)
        creds, host = rest.rsplit("@", 1)
        user = creds.split(":", 1)[0]
        return f"{scheme}://{user}:***@{host}" if ":" in creds else f"{scheme}://{user}@{host}"
    return url


def _host_port(node: str) -> str:
    host, sep, port = node.rpartition(":")
    if not sep or not host.strip("[]") or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError("expected host:port")
    return node


def expand_env(value: Any) -> Any:
    """``${NAME}`` in a string → the environment variable ``NAME`` (so secrets stay out of config files).

    Only the braced form is expanded (a ``$`` elsewhere is kept, passwords may contain it); an unset
    variable is an error naming it.
    """
    if not isinstance(value, str):
        return value

    def one(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in os.environ:
            raise ValueError(f"environment variable {name} is not set")
        return os.environ[name]

    return _ENV_REFERENCE.sub(one, value)


_PATH_ENV_REFERENCE = re.compile(r"\$(?:\{([A-Za-z_][A-Za-z0-9_]*)\}|([A-Za-z_][A-Za-z0-9_]*))")


def expand_path_env(value: str) -> str:
    """``${NAME}`` and ``$NAME`` in a path → the variable's value; an unset one is an error naming it.

    (``os.path.expandvars`` keeps an unset reference as text, which would create a directory named
    ``${NAME}``.)
    """

    def one(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        if name not in os.environ:
            raise ValueError(f"environment variable {name} is not set (in {value!r})")
        return os.environ[name]

    return _PATH_ENV_REFERENCE.sub(one, value)


class RedisTierConfig(_Strict):
    """Redis evicts on its own (``maxmemory``), so this tier has no capacity or eviction keys.

    ``url``, ``username``, ``password`` and ``tls_ca_file`` may name environment variables as ``${NAME}``.
    """

    type: Literal["redis"]
    name: str | None = None
    url: str | None = Field(default=None, repr=False)
    cluster: bool = False
    startup_nodes: list[Annotated[str, AfterValidator(_host_port)]] | None = Field(default=None, min_length=1)
    username: str | None = None
    password: str | None = Field(default=None, repr=False)
    tls_ca_file: str | None = None
    ttl_seconds: float | None = Field(default=None, gt=0, strict=True)
    compression: Literal["none", "lz4"] = "none"
    connect_timeout: float = Field(default=1.0, gt=0)
    timeout: float = Field(default=2.0, gt=0)
    max_connections: int = Field(default=16, gt=0)
    #: The breaker's own model (kvtier/tiers/redis/breaker.py), handed to the tier as validated here.
    circuit_breaker: CircuitBreakerConfig = CircuitBreakerConfig()
    admission: Literal["always", "second_sighting", "tinylfu"] = "always"

    @field_validator("url", "username", "password", "tls_ca_file", mode="before")
    @classmethod
    def _from_environment(cls, value: Any) -> Any:
        return expand_env(value)

    @field_validator("url")
    @classmethod
    def _url(cls, value: str | None) -> str | None:
        if value is None:
            return value
        parsed = urlsplit(value)
        try:
            parsed.port  # noqa: B018 - parsing the port is the check
            int(parsed.path.strip("/") or 0)
        except ValueError:
            raise ValueError("expected redis://[user:password@]host:port/db; the port or database "
                             "number is not a number") from None
        if parsed.scheme not in ("redis", "rediss"):
            raise ValueError("expected redis://[user:password@]host:port/db, or rediss://… for TLS")
        return value

    @model_validator(mode="after")
    def _where(self) -> RedisTierConfig:
        from kvtier.extras import missing

        problem = missing("redis")
        if problem:
            raise ValueError(problem)
        if self.cluster and not self.startup_nodes and not self.url:
            raise ValueError("a cluster needs startup_nodes (a list of host:port) or a url")
        if not self.cluster and self.startup_nodes:
            raise ValueError("startup_nodes is given but cluster is false; set cluster: true")
        if not self.cluster and not self.url:
            raise ValueError("set url (redis://host:port/db) or cluster: true with startup_nodes")
        if self.cluster and self.url and int(urlsplit(self.url).path.strip("/") or 0) != 0:
            raise ValueError("a Redis Cluster has only database 0; remove the database number from url")
        return self


TierConfig = Annotated[GpuTierConfig | CpuTierConfig | FileTierConfig | RedisTierConfig,
                       Field(discriminator="type")]


class PlacementConfig(_Strict):
    write_mode: Literal["write_back", "write_through"] = "write_back"
    promote_on_hit: bool = True
    promote_to: int = Field(default=0, ge=0)
    keep_lower_copy: bool = True
    admission_history: int = Field(default=65536, gt=0)
    #: write memory-tier blocks down to the persistent tier on close() and SIGTERM (None: when one exists)
    persist_on_close: bool | None = None
    persist_budget_seconds: float = Field(default=10.0, gt=0)


class MetricsConfig(_Strict):
    """Optional Prometheus endpoint (``http://address:port/metrics``); off unless ``port`` is set."""

    port: int | None = Field(default=None, ge=0, le=65535)
    address: str = "127.0.0.1"


class KVTierConfig(_Strict):
    """The whole configuration file."""

    model: ModelConfig
    hash_block_size: int = Field(default=16, gt=0)
    block_size: int | None = Field(default=None, gt=0)
    groups: list[GroupConfig] | None = None
    tiers: list[TierConfig] = Field(min_length=1)
    placement: PlacementConfig = PlacementConfig()
    metrics: MetricsConfig = MetricsConfig()

    @field_validator("groups")
    @classmethod
    def _groups(cls, value: list[GroupConfig] | None) -> list[GroupConfig] | None:
        if value is not None and not value:
            raise ValueError("an empty list of KV-cache groups stores nothing; remove the key for one group "
                             "of hash_block_size tokens")
        return value

    @model_validator(mode="after")
    def _cross_checks(self) -> KVTierConfig:
        names = [tier_name(t, i) for i, t in enumerate(self.tiers)]
        dupes = {n for n in names if names.count(n) > 1}
        if dupes:
            raise ValueError(f"tier names must be unique; repeated: {sorted(dupes)} (set `name:` on each)")
        if self.placement.promote_to >= len(self.tiers):
            raise ValueError(f"placement.promote_to={self.placement.promote_to} but there are only "
                             f"{len(self.tiers)} tiers (index 0 is the top)")
        if self.model.mla and self.model.num_kv_heads != 1:
            raise ValueError("model.mla is true, so model.num_kv_heads must be 1 "
                             "(one latent vector per token)")
        return self


def _placement_problems(cfg: KVTierConfig, plans: Sequence[GroupPlan]) -> list[tuple[str, str]]:
    """(key path, problem) of tiers that can hold no block, and of file tiers sharing a directory."""
    problems = []
    set_bytes = sum(p.geometry.nbytes for p in plans)
    seen: dict[str, int] = {}
    for i, t in enumerate(cfg.tiers):
        if isinstance(t, RedisTierConfig):
            continue
        if plans and t.capacity < set_bytes:
            problems.append((f"tiers[{i}].capacity",
                             f"{t.capacity} bytes holds no block: one block of every KV-cache group takes "
                             f"{set_bytes} bytes ({', '.join(p.geometry.describe() for p in plans)})"))
        if isinstance(t, FileTierConfig):
            where = os.path.realpath(t.path)
            if where in seen:
                problems.append((f"tiers[{i}].path",
                                 f"{t.path!r} is also the directory of tiers[{seen[where]}]; "
                                 f"two tiers would write the same files: give each its own"))
            seen.setdefault(where, i)
    return problems


def tier_name(tier: GpuTierConfig | CpuTierConfig | FileTierConfig | RedisTierConfig, index: int) -> str:
    return tier.name or tier.type


def _format_loc(loc: tuple[int | str, ...]) -> str:
    parts: list[str] = []
    previous: int | str | None = None
    for item in loc:
        if isinstance(item, int):
            parts.append(f"[{item}]")
        elif isinstance(previous, int) and item in ("gpu", "cpu", "file", "redis"):
            pass  # the discriminator tag pydantic inserts after a tier's index
        elif item.startswith("function-") or item == "":
            pass
        else:
            parts.append(("." if parts else "") + item)
        previous = item
    return "".join(parts) or "<root>"


def read_config_mapping(source: str | Path | Mapping[str, Any] | KVTierConfig,
                        where: str = "") -> dict[str, Any]:
    """A config as a plain mapping, from a YAML file path, YAML text, a mapping or a validated config.

    ``where`` prefixes error paths (``kvtier_config`` when a connector reads it from an engine's options).
    """
    if isinstance(source, KVTierConfig):
        return source.model_dump(exclude_none=True)
    if isinstance(source, Mapping):
        return dict(source)
    text = str(source)
    path = Path(text)
    if "\n" not in text and (path.suffix in (".yaml", ".yml") or path.exists()):
        try:
            text = path.read_text()
        except OSError as exc:
            raise KVTierConfigError(where, f"cannot read config file {path}: {exc.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except (yaml.YAMLError, ValueError) as exc:
        # ValueError: a scalar YAML resolves but cannot build (2001-13-01)
        raise KVTierConfigError(where, f"invalid YAML: {exc}") from None
    if not isinstance(data, Mapping):
        raise KVTierConfigError(where or "<root>",
                                f"expected a mapping of config keys, got {type(data).__name__}")
    return dict(data)


#: What ``load_config(..., engine_supplies_model=True)`` fills a missing ``model`` (or its missing keys)
#: with: the engine (vLLM) supplies the real model, groups and block sizes at start-up.
PLACEHOLDER_MODEL = {"name": "from-the-engine", "num_layers": 1, "num_kv_heads": 1, "head_dim": 1}


def load_config(source: str | Path | Mapping[str, Any], *,
                engine_supplies_model: bool = False) -> KVTierConfig:
    """Read and validate a config from a YAML file path, YAML text, or a mapping.

    Raises :class:`KVTierConfigError` whose message starts with the key path (``tiers[1].capacity``) of
    the first problem; its ``problems`` list every one. With ``engine_supplies_model`` (a serving
    engine's connector will supply the model and its block sizes) a missing ``model`` is allowed and the
    checks that need a block's size are left to start-up.
    """
    data = read_config_mapping(source)
    if engine_supplies_model and "model" not in data:
        data["model"] = dict(PLACEHOLDER_MODEL)
    elif engine_supplies_model and isinstance(data["model"], Mapping):  # e.g. only `name`, for the namespace
        data["model"] = {**PLACEHOLDER_MODEL, **data["model"]}
    try:
        cfg = KVTierConfig.model_validate(data)
    except ValidationError as exc:
        errors = [_describe_error(err) for err in exc.errors()]
        path, message = errors[0]
        more = f" [and {len(errors) - 1} more errors]" if len(errors) > 1 else ""
        raise KVTierConfigError(path, f"{message}{more}",
                                problems=tuple(f"{p}: {m}" for p, m in errors)) from None
    _, plans = plan_groups(cfg)  # block-size rules are checked now, not at first store
    problems = _placement_problems(cfg, [] if engine_supplies_model else plans)
    if problems:
        path, message = problems[0]
        more = f" [and {len(problems) - 1} more errors]" if len(problems) > 1 else ""
        raise KVTierConfigError(path, f"{message}{more}", problems=tuple(f"{p}: {m}" for p, m in problems))
    return cfg


def _describe_error(err: Any) -> tuple[str, str]:
    """(key path, message with the bad value unless it is a secret or a whole mapping) of a pydantic error."""
    loc = _format_loc(err["loc"])
    value = err.get("input")
    secret = loc.rsplit(".", 1)[-1] in _SECRET_KEYS
    shown = "" if isinstance(value, Mapping) or secret else f" (got {value!r})"
    return loc, f"{err['msg']}{shown}"


@dataclass(frozen=True)
class GroupPlan:
    """One KV-cache group of a config by numbers only (torch-free; :func:`build_spec` makes it a KVGroup)."""

    group_id: int
    name: str
    gpu_block_size: int
    geometry: BlockGeometry


def plan_groups(cfg: KVTierConfig) -> tuple[int, tuple[GroupPlan, ...]]:
    """(block_size_factor, groups) of a config, validated against vLLM's block-size rules, without torch."""
    m = cfg.model
    group_cfgs = cfg.groups if cfg.groups is not None else [GroupConfig(block_size=cfg.hash_block_size)]
    factor = resolve_block_size_factor([g.block_size for g in group_cfgs], cfg.hash_block_size,
                                       cfg.block_size)
    plans = tuple(
        GroupPlan(i, g.name, g.block_size, BlockGeometry(
            num_layers=g.num_layers or m.num_layers, num_kv_heads=g.num_kv_heads or m.num_kv_heads,
            head_dim=g.head_dim or m.head_dim, block_size=g.block_size * factor, dtype=m.dtype,
            kv_factor=1 if m.mla else 2, token_layout=m.token_layout))
        for i, g in enumerate(group_cfgs))
    return factor, plans


def build_spec(cfg: KVTierConfig) -> KVCacheSpec:
    """Groups and the offload factor, validated against vLLM's block-size rules."""
    from kvtier.layout import BlockLayout, parse_dtype

    factor, plans = plan_groups(cfg)
    groups = []
    for p in plans:
        geo = p.geometry
        layout = BlockLayout(num_layers=geo.num_layers, num_kv_heads=geo.num_kv_heads, head_dim=geo.head_dim,
                             block_size=geo.block_size, dtype=parse_dtype(geo.dtype), kv_factor=geo.kv_factor,
                             token_layout=cfg.model.token_layout)
        groups.append(KVGroup(group_id=p.group_id, gpu_block_size=p.gpu_block_size, layout=layout,
                              name=p.name))
    return KVCacheSpec(hash_block_size=cfg.hash_block_size, groups=tuple(groups), block_size_factor=factor)


def build_namespace(cfg: KVTierConfig, spec: KVCacheSpec) -> Namespace:
    return namespace_for(cfg, [(g.group_id, g.layout.geometry) for g in spec.groups])


def namespace_for(cfg: KVTierConfig, groups: Sequence[tuple[int, BlockGeometry]]) -> Namespace:
    """The namespace of a config's model and its groups' geometries (torch-free)."""
    layout_fp = 0
    for group_id, geometry in groups:
        layout_fp ^= geometry.fingerprint() + group_id
    return Namespace(model=cfg.model.name, dtype=cfg.model.dtype, layout_fingerprint=layout_fp,
                     tp_rank=cfg.model.tp_rank, tp_size=cfg.model.tp_size)


def split_capacity(capacity: int, spec: KVCacheSpec) -> dict[int, int]:
    """Share a tier's bytes among groups so each group can hold the same number of blocks."""
    if not spec.groups:
        return {}
    per_set = sum(g.layout.nbytes for g in spec.groups)
    blocks = capacity // per_set
    return {g.group_id: blocks * g.layout.nbytes for g in spec.groups}


def build_cache_parts(cfg: KVTierConfig) -> tuple[Any, ...]:
    """(spec, tiers, residency, namespace) for :class:`kvtier.cache.AsyncTieredCache`."""
    from kvtier.policy.admission import make_admission_policy
    from kvtier.policy.placement import PlacementPolicy
    from kvtier.residency import Residency, TierIndex

    spec = build_spec(cfg)
    namespace = build_namespace(cfg, spec)
    layouts = {g.group_id: g.layout for g in spec.groups}
    tiers = []
    indexes = []
    admissions = []
    for i, tc in enumerate(cfg.tiers):
        name = tier_name(tc, i)
        tier = _build_tier(tc, name, layouts, spec, namespace, f"tiers[{i}]")
        tiers.append(tier)
        block_bytes = {g: layout.nbytes for g, layout in layouts.items()}
        indexes.append(TierIndex(name, tier.capacity_bytes, block_bytes,
                                 getattr(tc, "eviction", "default"), self_evicting=tier.self_evicting))
        admissions.append(make_admission_policy(tc.admission, cfg.placement.admission_history))
    p = cfg.placement
    placement = PlacementPolicy(admission=admissions, write_mode=p.write_mode,
                                promote_on_hit=p.promote_on_hit, promote_to=p.promote_to,
                                keep_lower_copy=p.keep_lower_copy)
    return spec, tiers, Residency(indexes, placement), namespace


def _build_tier(tc: Any, name: str, layouts: dict[int, BlockLayout], spec: KVCacheSpec, namespace: Namespace,
                path: str) -> Any:
    if isinstance(tc, GpuTierConfig):
        from kvtier.tiers.gpu import GpuTier, TransferChoice

        transfer = TransferChoice(tc.transfer.method, tc.transfer.crossover)
        try:
            return GpuTier(name, layouts, split_capacity(tc.capacity, spec), device=tc.device,
                           transfer=transfer)
        except TierUnavailable as exc:
            raise KVTierConfigError(path, f"a gpu tier cannot start here: {exc}") from None
    if isinstance(tc, CpuTierConfig):
        from kvtier.tiers.cpu import CpuTier

        try:
            return CpuTier(name, layouts, split_capacity(tc.capacity, spec),
                           pinned=None if tc.pinned == "auto" else tc.pinned,
                           copy_threads=None if tc.copy_threads == "auto" else tc.copy_threads,
                           streaming_stores=tc.streaming_stores)
        except OSError as exc:  # the host cannot map that much memory
            raise KVTierConfigError(f"{path}.capacity", f"cannot reserve {tc.capacity} bytes of host memory: "
                                                        f"{exc.strerror or exc}") from None
    if isinstance(tc, FileTierConfig):
        from kvtier.tiers.file import FileTier

        root = Path(tc.path)  # ~ and environment variables were expanded at load time
        try:
            return FileTier(name, layouts, split_capacity(tc.capacity, spec), root=root,
                            namespace=namespace.id, compression=tc.compression, direct_io=tc.direct_io,
                            write_io=tc.write_io, io_threads=tc.io_threads, fsync=tc.fsync,
                            namespace_fp=namespace.fingerprint)
        except KVTierConfigError as exc:  # e.g. a directory another user controls: keyed by this tier
            raise KVTierConfigError(f"{path}.{exc.path}", str(exc).removeprefix(f"{exc.path}: ")) from None
        except (OSError, TierUnavailable) as exc:
            raise KVTierConfigError(f"{path}.path", f"cannot use {str(root)!r}: {exc}") from None
    from kvtier.extras import MissingExtra, require

    try:
        require("redis")
    except MissingExtra as exc:  # installed at load time, gone (or broken) now
        raise KVTierConfigError(f"{path}.type", str(exc)) from None
    from kvtier.tiers.redis import RedisTier

    kwargs = {field: getattr(tc, field) for field in type(tc).model_fields
              if field not in ("type", "name", "admission")}
    try:
        return RedisTier(name, layouts, {g: 0 for g in layouts}, namespace=namespace.id,
                         namespace_fp=namespace.fingerprint, **kwargs)
    except TierUnavailable as exc:
        raise KVTierConfigError(path, f"a redis tier cannot start here: {exc}") from None
