from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GenerationCause(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    GENERATION_CAUSE_UNSPECIFIED: _ClassVar[GenerationCause]
    GENERATION_CAUSE_FIRST: _ClassVar[GenerationCause]
    GENERATION_CAUSE_BROKEN: _ClassVar[GenerationCause]
    GENERATION_CAUSE_DROPPED: _ClassVar[GenerationCause]
    GENERATION_CAUSE_HUNG: _ClassVar[GenerationCause]
    GENERATION_CAUSE_LEFT: _ClassVar[GenerationCause]
    GENERATION_CAUSE_EXPIRED: _ClassVar[GenerationCause]
    GENERATION_CAUSE_RESIZED: _ClassVar[GenerationCause]
    GENERATION_CAUSE_JOINED: _ClassVar[GenerationCause]
    GENERATION_CAUSE_CAPPED: _ClassVar[GenerationCause]
    GENERATION_CAUSE_BELOW_MIN_NP: _ClassVar[GenerationCause]
    GENERATION_CAUSE_UNREACHABLE: _ClassVar[GenerationCause]

class FenceCause(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FENCE_CAUSE_UNSPECIFIED: _ClassVar[FenceCause]
    FENCE_CAUSE_HUNG: _ClassVar[FenceCause]

class DoneCause(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DONE_CAUSE_UNSPECIFIED: _ClassVar[DoneCause]
    DONE_CAUSE_RETURNED: _ClassVar[DoneCause]
    DONE_CAUSE_RESET_LIMIT: _ClassVar[DoneCause]
    DONE_CAUSE_ELASTIC_TIMEOUT: _ClassVar[DoneCause]
GENERATION_CAUSE_UNSPECIFIED: GenerationCause
GENERATION_CAUSE_FIRST: GenerationCause
GENERATION_CAUSE_BROKEN: GenerationCause
GENERATION_CAUSE_DROPPED: GenerationCause
GENERATION_CAUSE_HUNG: GenerationCause
GENERATION_CAUSE_LEFT: GenerationCause
GENERATION_CAUSE_EXPIRED: GenerationCause
GENERATION_CAUSE_RESIZED: GenerationCause
GENERATION_CAUSE_JOINED: GenerationCause
GENERATION_CAUSE_CAPPED: GenerationCause
GENERATION_CAUSE_BELOW_MIN_NP: GenerationCause
GENERATION_CAUSE_UNREACHABLE: GenerationCause
FENCE_CAUSE_UNSPECIFIED: FenceCause
FENCE_CAUSE_HUNG: FenceCause
DONE_CAUSE_UNSPECIFIED: DoneCause
DONE_CAUSE_RETURNED: DoneCause
DONE_CAUSE_RESET_LIMIT: DoneCause
DONE_CAUSE_ELASTIC_TIMEOUT: DoneCause

class JobConfig(_message.Message):
    __slots__ = ("min_np", "max_np", "lease_ttl_s", "join_timeout_s", "elastic_timeout_s", "reset_limit", "blacklist_after", "blacklist_cooldown_s", "settle_s", "start_settle_s", "run_ttl_s", "paused", "hang_timeout_s", "snapshot_dir", "snapshot_every_s", "snapshot_keep", "hang_first_step_s", "straggler_policy", "straggler_threshold", "straggler_window_s", "straggler_cooldown_s")
    MIN_NP_FIELD_NUMBER: _ClassVar[int]
    MAX_NP_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_S_FIELD_NUMBER: _ClassVar[int]
    JOIN_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    ELASTIC_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    RESET_LIMIT_FIELD_NUMBER: _ClassVar[int]
    BLACKLIST_AFTER_FIELD_NUMBER: _ClassVar[int]
    BLACKLIST_COOLDOWN_S_FIELD_NUMBER: _ClassVar[int]
    SETTLE_S_FIELD_NUMBER: _ClassVar[int]
    START_SETTLE_S_FIELD_NUMBER: _ClassVar[int]
    RUN_TTL_S_FIELD_NUMBER: _ClassVar[int]
    PAUSED_FIELD_NUMBER: _ClassVar[int]
    HANG_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_DIR_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_EVERY_S_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_KEEP_FIELD_NUMBER: _ClassVar[int]
    HANG_FIRST_STEP_S_FIELD_NUMBER: _ClassVar[int]
    STRAGGLER_POLICY_FIELD_NUMBER: _ClassVar[int]
    STRAGGLER_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    STRAGGLER_WINDOW_S_FIELD_NUMBER: _ClassVar[int]
    STRAGGLER_COOLDOWN_S_FIELD_NUMBER: _ClassVar[int]
    min_np: int
    max_np: int
    lease_ttl_s: float
    join_timeout_s: float
    elastic_timeout_s: float
    reset_limit: int
    blacklist_after: int
    blacklist_cooldown_s: float
    settle_s: float
    start_settle_s: float
    run_ttl_s: float
    paused: bool
    hang_timeout_s: float
    snapshot_dir: str
    snapshot_every_s: float
    snapshot_keep: int
    hang_first_step_s: float
    straggler_policy: str
    straggler_threshold: float
    straggler_window_s: float
    straggler_cooldown_s: float
    def __init__(self, min_np: _Optional[int] = ..., max_np: _Optional[int] = ..., lease_ttl_s: _Optional[float] = ..., join_timeout_s: _Optional[float] = ..., elastic_timeout_s: _Optional[float] = ..., reset_limit: _Optional[int] = ..., blacklist_after: _Optional[int] = ..., blacklist_cooldown_s: _Optional[float] = ..., settle_s: _Optional[float] = ..., start_settle_s: _Optional[float] = ..., run_ttl_s: _Optional[float] = ..., paused: _Optional[bool] = ..., hang_timeout_s: _Optional[float] = ..., snapshot_dir: _Optional[str] = ..., snapshot_every_s: _Optional[float] = ..., snapshot_keep: _Optional[int] = ..., hang_first_step_s: _Optional[float] = ..., straggler_policy: _Optional[str] = ..., straggler_threshold: _Optional[float] = ..., straggler_window_s: _Optional[float] = ..., straggler_cooldown_s: _Optional[float] = ...) -> None: ...

class RunRecord(_message.Message):
    __slots__ = ("schema", "run_id", "config", "lease_id", "created_unix", "created_by", "overridden")
    SCHEMA_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_FIELD_NUMBER: _ClassVar[int]
    CREATED_BY_FIELD_NUMBER: _ClassVar[int]
    OVERRIDDEN_FIELD_NUMBER: _ClassVar[int]
    schema: int
    run_id: str
    config: JobConfig
    lease_id: int
    created_unix: float
    created_by: str
    overridden: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, schema: _Optional[int] = ..., run_id: _Optional[str] = ..., config: _Optional[_Union[JobConfig, _Mapping]] = ..., lease_id: _Optional[int] = ..., created_unix: _Optional[float] = ..., created_by: _Optional[str] = ..., overridden: _Optional[_Iterable[str]] = ...) -> None: ...

class MemberRecord(_message.Message):
    __slots__ = ("schema", "member_id", "host", "address", "pid", "local_rank", "labels", "lease_id", "version", "started_unix", "net_address", "probe_port")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SCHEMA_FIELD_NUMBER: _ClassVar[int]
    MEMBER_ID_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STARTED_UNIX_FIELD_NUMBER: _ClassVar[int]
    NET_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PROBE_PORT_FIELD_NUMBER: _ClassVar[int]
    schema: int
    member_id: str
    host: str
    address: str
    pid: int
    local_rank: int
    labels: _containers.ScalarMap[str, str]
    lease_id: int
    version: str
    started_unix: float
    net_address: str
    probe_port: int
    def __init__(self, schema: _Optional[int] = ..., member_id: _Optional[str] = ..., host: _Optional[str] = ..., address: _Optional[str] = ..., pid: _Optional[int] = ..., local_rank: _Optional[int] = ..., labels: _Optional[_Mapping[str, str]] = ..., lease_id: _Optional[int] = ..., version: _Optional[str] = ..., started_unix: _Optional[float] = ..., net_address: _Optional[str] = ..., probe_port: _Optional[int] = ...) -> None: ...

class GenerationRecord(_message.Message):
    __slots__ = ("schema", "number", "roster", "reason", "written_by", "written_unix", "joined", "removed", "detected_unix", "causes")
    SCHEMA_FIELD_NUMBER: _ClassVar[int]
    NUMBER_FIELD_NUMBER: _ClassVar[int]
    ROSTER_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    WRITTEN_BY_FIELD_NUMBER: _ClassVar[int]
    WRITTEN_UNIX_FIELD_NUMBER: _ClassVar[int]
    JOINED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    DETECTED_UNIX_FIELD_NUMBER: _ClassVar[int]
    CAUSES_FIELD_NUMBER: _ClassVar[int]
    schema: int
    number: int
    roster: _containers.RepeatedScalarFieldContainer[str]
    reason: str
    written_by: str
    written_unix: float
    joined: _containers.RepeatedScalarFieldContainer[str]
    removed: _containers.RepeatedScalarFieldContainer[str]
    detected_unix: float
    causes: _containers.RepeatedScalarFieldContainer[GenerationCause]
    def __init__(self, schema: _Optional[int] = ..., number: _Optional[int] = ..., roster: _Optional[_Iterable[str]] = ..., reason: _Optional[str] = ..., written_by: _Optional[str] = ..., written_unix: _Optional[float] = ..., joined: _Optional[_Iterable[str]] = ..., removed: _Optional[_Iterable[str]] = ..., detected_unix: _Optional[float] = ..., causes: _Optional[_Iterable[_Union[GenerationCause, str]]] = ...) -> None: ...

class AckRecord(_message.Message):
    __slots__ = ("schema", "member_id", "generation", "unix", "detail")
    SCHEMA_FIELD_NUMBER: _ClassVar[int]
    MEMBER_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    UNIX_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    schema: int
    member_id: str
    generation: int
    unix: float
    detail: str
    def __init__(self, schema: _Optional[int] = ..., member_id: _Optional[str] = ..., generation: _Optional[int] = ..., unix: _Optional[float] = ..., detail: _Optional[str] = ...) -> None: ...

class DrainRecord(_message.Message):
    __slots__ = ("schema", "member_id", "requested_by", "unix")
    SCHEMA_FIELD_NUMBER: _ClassVar[int]
    MEMBER_ID_FIELD_NUMBER: _ClassVar[int]
    REQUESTED_BY_FIELD_NUMBER: _ClassVar[int]
    UNIX_FIELD_NUMBER: _ClassVar[int]
    schema: int
    member_id: str
    requested_by: str
    unix: float
    def __init__(self, schema: _Optional[int] = ..., member_id: _Optional[str] = ..., requested_by: _Optional[str] = ..., unix: _Optional[float] = ...) -> None: ...

class FenceRecord(_message.Message):
    __slots__ = ("schema", "member_id", "cause", "detail", "unix", "generation")
    SCHEMA_FIELD_NUMBER: _ClassVar[int]
    MEMBER_ID_FIELD_NUMBER: _ClassVar[int]
    CAUSE_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    UNIX_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    schema: int
    member_id: str
    cause: FenceCause
    detail: str
    unix: float
    generation: int
    def __init__(self, schema: _Optional[int] = ..., member_id: _Optional[str] = ..., cause: _Optional[_Union[FenceCause, str]] = ..., detail: _Optional[str] = ..., unix: _Optional[float] = ..., generation: _Optional[int] = ...) -> None: ...

class ReachRecord(_message.Message):
    __slots__ = ("schema", "member_id", "unreachable", "generation", "unix")
    SCHEMA_FIELD_NUMBER: _ClassVar[int]
    MEMBER_ID_FIELD_NUMBER: _ClassVar[int]
    UNREACHABLE_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    UNIX_FIELD_NUMBER: _ClassVar[int]
    schema: int
    member_id: str
    unreachable: _containers.RepeatedScalarFieldContainer[str]
    generation: int
    unix: float
    def __init__(self, schema: _Optional[int] = ..., member_id: _Optional[str] = ..., unreachable: _Optional[_Iterable[str]] = ..., generation: _Optional[int] = ..., unix: _Optional[float] = ...) -> None: ...

class HostRecord(_message.Message):
    __slots__ = ("schema", "host", "failures", "unix", "reason")
    SCHEMA_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    FAILURES_FIELD_NUMBER: _ClassVar[int]
    UNIX_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    schema: int
    host: str
    failures: int
    unix: float
    reason: str
    def __init__(self, schema: _Optional[int] = ..., host: _Optional[str] = ..., failures: _Optional[int] = ..., unix: _Optional[float] = ..., reason: _Optional[str] = ...) -> None: ...

class ProgressRecord(_message.Message):
    __slots__ = ("schema", "generation", "epoch", "batch", "step", "world_size", "unix", "commits")
    SCHEMA_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    UNIX_FIELD_NUMBER: _ClassVar[int]
    COMMITS_FIELD_NUMBER: _ClassVar[int]
    schema: int
    generation: int
    epoch: int
    batch: int
    step: int
    world_size: int
    unix: float
    commits: int
    def __init__(self, schema: _Optional[int] = ..., generation: _Optional[int] = ..., epoch: _Optional[int] = ..., batch: _Optional[int] = ..., step: _Optional[int] = ..., world_size: _Optional[int] = ..., unix: _Optional[float] = ..., commits: _Optional[int] = ...) -> None: ...

class StateRecord(_message.Message):
    __slots__ = ("schema", "commits", "generation", "unix", "written_by")
    SCHEMA_FIELD_NUMBER: _ClassVar[int]
    COMMITS_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    UNIX_FIELD_NUMBER: _ClassVar[int]
    WRITTEN_BY_FIELD_NUMBER: _ClassVar[int]
    schema: int
    commits: int
    generation: int
    unix: float
    written_by: str
    def __init__(self, schema: _Optional[int] = ..., commits: _Optional[int] = ..., generation: _Optional[int] = ..., unix: _Optional[float] = ..., written_by: _Optional[str] = ...) -> None: ...

class PeerPace(_message.Message):
    __slots__ = ("member_id", "score", "own_s", "waited_s")
    MEMBER_ID_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    OWN_S_FIELD_NUMBER: _ClassVar[int]
    WAITED_S_FIELD_NUMBER: _ClassVar[int]
    member_id: str
    score: float
    own_s: float
    waited_s: float
    def __init__(self, member_id: _Optional[str] = ..., score: _Optional[float] = ..., own_s: _Optional[float] = ..., waited_s: _Optional[float] = ...) -> None: ...

class PaceRecord(_message.Message):
    __slots__ = ("schema", "generation", "unix", "step_s", "peers")
    SCHEMA_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    UNIX_FIELD_NUMBER: _ClassVar[int]
    STEP_S_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    schema: int
    generation: int
    unix: float
    step_s: float
    peers: _containers.RepeatedCompositeFieldContainer[PeerPace]
    def __init__(self, schema: _Optional[int] = ..., generation: _Optional[int] = ..., unix: _Optional[float] = ..., step_s: _Optional[float] = ..., peers: _Optional[_Iterable[_Union[PeerPace, _Mapping]]] = ...) -> None: ...

class DoneRecord(_message.Message):
    __slots__ = ("schema", "success", "reason", "written_by", "unix", "generation", "cause")
    SCHEMA_FIELD_NUMBER: _ClassVar[int]
    SUCCESS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    WRITTEN_BY_FIELD_NUMBER: _ClassVar[int]
    UNIX_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    CAUSE_FIELD_NUMBER: _ClassVar[int]
    schema: int
    success: bool
    reason: str
    written_by: str
    unix: float
    generation: int
    cause: DoneCause
    def __init__(self, schema: _Optional[int] = ..., success: _Optional[bool] = ..., reason: _Optional[str] = ..., written_by: _Optional[str] = ..., unix: _Optional[float] = ..., generation: _Optional[int] = ..., cause: _Optional[_Union[DoneCause, str]] = ...) -> None: ...

class EventRecord(_message.Message):
    __slots__ = ("schema", "kind", "member_id", "generation", "detail", "unix", "timings_s", "world_size", "causes", "host", "score")
    class TimingsSEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    SCHEMA_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    MEMBER_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    UNIX_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_S_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    CAUSES_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    schema: int
    kind: str
    member_id: str
    generation: int
    detail: str
    unix: float
    timings_s: _containers.ScalarMap[str, float]
    world_size: int
    causes: _containers.RepeatedScalarFieldContainer[GenerationCause]
    host: str
    score: float
    def __init__(self, schema: _Optional[int] = ..., kind: _Optional[str] = ..., member_id: _Optional[str] = ..., generation: _Optional[int] = ..., detail: _Optional[str] = ..., unix: _Optional[float] = ..., timings_s: _Optional[_Mapping[str, float]] = ..., world_size: _Optional[int] = ..., causes: _Optional[_Iterable[_Union[GenerationCause, str]]] = ..., host: _Optional[str] = ..., score: _Optional[float] = ...) -> None: ...

class SnapshotRecord(_message.Message):
    __slots__ = ("schema", "name", "path", "commits", "epoch", "step", "unix", "checksum", "run_id", "bytes", "host")
    SCHEMA_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    COMMITS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    UNIX_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    schema: int
    name: str
    path: str
    commits: int
    epoch: int
    step: int
    unix: float
    checksum: str
    run_id: str
    bytes: int
    host: str
    def __init__(self, schema: _Optional[int] = ..., name: _Optional[str] = ..., path: _Optional[str] = ..., commits: _Optional[int] = ..., epoch: _Optional[int] = ..., step: _Optional[int] = ..., unix: _Optional[float] = ..., checksum: _Optional[str] = ..., run_id: _Optional[str] = ..., bytes: _Optional[int] = ..., host: _Optional[str] = ...) -> None: ...
