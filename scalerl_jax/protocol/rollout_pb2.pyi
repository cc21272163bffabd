from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    INT32: _ClassVar[DType]
    FLOAT32: _ClassVar[DType]
    BITS: _ClassVar[DType]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_STOP: _ClassVar[FinishReason]
    FINISH_LENGTH: _ClassVar[FinishReason]
    FINISH_INTERRUPTED: _ClassVar[FinishReason]
DTYPE_UNSPECIFIED: DType
INT32: DType
FLOAT32: DType
BITS: DType
FINISH_UNSPECIFIED: FinishReason
FINISH_STOP: FinishReason
FINISH_LENGTH: FinishReason
FINISH_INTERRUPTED: FinishReason

class Tensor(_message.Message):
    __slots__ = ("dtype", "length", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: DType
    length: int
    data: bytes
    def __init__(self, dtype: _Optional[_Union[DType, str]] = ..., length: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class Timing(_message.Message):
    __slots__ = ("start_unix_s", "end_unix_s")
    START_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    END_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    start_unix_s: float
    end_unix_s: float
    def __init__(self, start_unix_s: _Optional[float] = ..., end_unix_s: _Optional[float] = ...) -> None: ...

class Rollout(_message.Message):
    __slots__ = ("rollout_id", "prompt_id", "group_id", "sample_index", "prompt_tokens", "completion_tokens", "logprobs", "versions", "policy_mask", "rewards", "finish_reason", "generator_id", "timing", "routes")
    ROLLOUT_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_INDEX_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    POLICY_MASK_FIELD_NUMBER: _ClassVar[int]
    REWARDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    GENERATOR_ID_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    ROUTES_FIELD_NUMBER: _ClassVar[int]
    rollout_id: str
    prompt_id: int
    group_id: int
    sample_index: int
    prompt_tokens: Tensor
    completion_tokens: Tensor
    logprobs: Tensor
    versions: Tensor
    policy_mask: Tensor
    rewards: _containers.RepeatedScalarFieldContainer[float]
    finish_reason: FinishReason
    generator_id: str
    timing: Timing
    routes: Routes
    def __init__(self, rollout_id: _Optional[str] = ..., prompt_id: _Optional[int] = ..., group_id: _Optional[int] = ..., sample_index: _Optional[int] = ..., prompt_tokens: _Optional[_Union[Tensor, _Mapping]] = ..., completion_tokens: _Optional[_Union[Tensor, _Mapping]] = ..., logprobs: _Optional[_Union[Tensor, _Mapping]] = ..., versions: _Optional[_Union[Tensor, _Mapping]] = ..., policy_mask: _Optional[_Union[Tensor, _Mapping]] = ..., rewards: _Optional[_Iterable[float]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., generator_id: _Optional[str] = ..., timing: _Optional[_Union[Timing, _Mapping]] = ..., routes: _Optional[_Union[Routes, _Mapping]] = ...) -> None: ...

class Routes(_message.Message):
    __slots__ = ("experts", "layers", "k")
    EXPERTS_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    experts: Tensor
    layers: int
    k: int
    def __init__(self, experts: _Optional[_Union[Tensor, _Mapping]] = ..., layers: _Optional[int] = ..., k: _Optional[int] = ...) -> None: ...

class PushRequest(_message.Message):
    __slots__ = ("rollouts",)
    ROLLOUTS_FIELD_NUMBER: _ClassVar[int]
    rollouts: _containers.RepeatedCompositeFieldContainer[Rollout]
    def __init__(self, rollouts: _Optional[_Iterable[_Union[Rollout, _Mapping]]] = ...) -> None: ...

class PushResponse(_message.Message):
    __slots__ = ("acks",)
    ACKS_FIELD_NUMBER: _ClassVar[int]
    acks: _containers.RepeatedCompositeFieldContainer[Ack]
    def __init__(self, acks: _Optional[_Iterable[_Union[Ack, _Mapping]]] = ...) -> None: ...

class LeaseRequest(_message.Message):
    __slots__ = ("generator_id", "max_groups", "wait_timeout_s", "held_versions", "max_eval_groups")
    GENERATOR_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_GROUPS_FIELD_NUMBER: _ClassVar[int]
    WAIT_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    HELD_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_EVAL_GROUPS_FIELD_NUMBER: _ClassVar[int]
    generator_id: str
    max_groups: int
    wait_timeout_s: float
    held_versions: _containers.RepeatedScalarFieldContainer[int]
    max_eval_groups: int
    def __init__(self, generator_id: _Optional[str] = ..., max_groups: _Optional[int] = ..., wait_timeout_s: _Optional[float] = ..., held_versions: _Optional[_Iterable[int]] = ..., max_eval_groups: _Optional[int] = ...) -> None: ...

class Assignment(_message.Message):
    __slots__ = ("group_id", "prompt_id", "prompt_tokens", "answer", "group_size", "min_version", "max_version", "lease_expires_unix_s", "eval_id", "eval_seed", "temperature", "top_p", "task")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ANSWER_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    MIN_VERSION_FIELD_NUMBER: _ClassVar[int]
    MAX_VERSION_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRES_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    EVAL_ID_FIELD_NUMBER: _ClassVar[int]
    EVAL_SEED_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    group_id: int
    prompt_id: int
    prompt_tokens: Tensor
    answer: str
    group_size: int
    min_version: int
    max_version: int
    lease_expires_unix_s: float
    eval_id: int
    eval_seed: int
    temperature: float
    top_p: float
    task: str
    def __init__(self, group_id: _Optional[int] = ..., prompt_id: _Optional[int] = ..., prompt_tokens: _Optional[_Union[Tensor, _Mapping]] = ..., answer: _Optional[str] = ..., group_size: _Optional[int] = ..., min_version: _Optional[int] = ..., max_version: _Optional[int] = ..., lease_expires_unix_s: _Optional[float] = ..., eval_id: _Optional[int] = ..., eval_seed: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., task: _Optional[str] = ...) -> None: ...

class LeaseResponse(_message.Message):
    __slots__ = ("assignments", "current_version", "eval_versions")
    ASSIGNMENTS_FIELD_NUMBER: _ClassVar[int]
    CURRENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    EVAL_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    assignments: _containers.RepeatedCompositeFieldContainer[Assignment]
    current_version: int
    eval_versions: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, assignments: _Optional[_Iterable[_Union[Assignment, _Mapping]]] = ..., current_version: _Optional[int] = ..., eval_versions: _Optional[_Iterable[int]] = ...) -> None: ...

class Ack(_message.Message):
    __slots__ = ("rollout_id", "duplicate", "group_complete")
    ROLLOUT_ID_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    GROUP_COMPLETE_FIELD_NUMBER: _ClassVar[int]
    rollout_id: str
    duplicate: bool
    group_complete: bool
    def __init__(self, rollout_id: _Optional[str] = ..., duplicate: _Optional[bool] = ..., group_complete: _Optional[bool] = ...) -> None: ...

class PullRequest(_message.Message):
    __slots__ = ("learner_id", "step", "timeout_s")
    LEARNER_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    learner_id: str
    step: int
    timeout_s: float
    def __init__(self, learner_id: _Optional[str] = ..., step: _Optional[int] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class Group(_message.Message):
    __slots__ = ("group_id", "prompt_id", "rollouts")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_ID_FIELD_NUMBER: _ClassVar[int]
    ROLLOUTS_FIELD_NUMBER: _ClassVar[int]
    group_id: int
    prompt_id: int
    rollouts: _containers.RepeatedCompositeFieldContainer[Rollout]
    def __init__(self, group_id: _Optional[int] = ..., prompt_id: _Optional[int] = ..., rollouts: _Optional[_Iterable[_Union[Rollout, _Mapping]]] = ...) -> None: ...

class LagHistogram(_message.Message):
    __slots__ = ("counts", "negative", "max_lag")
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    NEGATIVE_FIELD_NUMBER: _ClassVar[int]
    MAX_LAG_FIELD_NUMBER: _ClassVar[int]
    counts: _containers.RepeatedScalarFieldContainer[int]
    negative: int
    max_lag: int
    def __init__(self, counts: _Optional[_Iterable[int]] = ..., negative: _Optional[int] = ..., max_lag: _Optional[int] = ...) -> None: ...

class BatchSummary(_message.Message):
    __slots__ = ("step", "num_groups", "lag", "generator_stats")
    class GeneratorStatsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    STEP_FIELD_NUMBER: _ClassVar[int]
    NUM_GROUPS_FIELD_NUMBER: _ClassVar[int]
    LAG_FIELD_NUMBER: _ClassVar[int]
    GENERATOR_STATS_FIELD_NUMBER: _ClassVar[int]
    step: int
    num_groups: int
    lag: LagHistogram
    generator_stats: _containers.ScalarMap[str, float]
    def __init__(self, step: _Optional[int] = ..., num_groups: _Optional[int] = ..., lag: _Optional[_Union[LagHistogram, _Mapping]] = ..., generator_stats: _Optional[_Mapping[str, float]] = ...) -> None: ...

class BatchItem(_message.Message):
    __slots__ = ("group", "summary")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    group: Group
    summary: BatchSummary
    def __init__(self, group: _Optional[_Union[Group, _Mapping]] = ..., summary: _Optional[_Union[BatchSummary, _Mapping]] = ...) -> None: ...

class WeightChunk(_message.Message):
    __slots__ = ("version", "total_bytes", "sha256", "format", "offset", "data", "crc32", "manifest", "chunk_index")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    CHUNK_INDEX_FIELD_NUMBER: _ClassVar[int]
    version: int
    total_bytes: int
    sha256: str
    format: str
    offset: int
    data: bytes
    crc32: int
    manifest: str
    chunk_index: int
    def __init__(self, version: _Optional[int] = ..., total_bytes: _Optional[int] = ..., sha256: _Optional[str] = ..., format: _Optional[str] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., crc32: _Optional[int] = ..., manifest: _Optional[str] = ..., chunk_index: _Optional[int] = ...) -> None: ...

class PublishAck(_message.Message):
    __slots__ = ("version", "total_bytes", "missing_chunks", "visible")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    MISSING_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    VISIBLE_FIELD_NUMBER: _ClassVar[int]
    version: int
    total_bytes: int
    missing_chunks: _containers.RepeatedScalarFieldContainer[int]
    visible: bool
    def __init__(self, version: _Optional[int] = ..., total_bytes: _Optional[int] = ..., missing_chunks: _Optional[_Iterable[int]] = ..., visible: _Optional[bool] = ...) -> None: ...

class FetchWeightsRequest(_message.Message):
    __slots__ = ("have_version", "wait_timeout_s", "chunk_bytes", "streamed", "resume_version", "have_chunks", "want_delta")
    HAVE_VERSION_FIELD_NUMBER: _ClassVar[int]
    WAIT_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    STREAMED_FIELD_NUMBER: _ClassVar[int]
    RESUME_VERSION_FIELD_NUMBER: _ClassVar[int]
    HAVE_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    WANT_DELTA_FIELD_NUMBER: _ClassVar[int]
    have_version: int
    wait_timeout_s: float
    chunk_bytes: int
    streamed: bool
    resume_version: int
    have_chunks: _containers.RepeatedScalarFieldContainer[int]
    want_delta: bool
    def __init__(self, have_version: _Optional[int] = ..., wait_timeout_s: _Optional[float] = ..., chunk_bytes: _Optional[int] = ..., streamed: _Optional[bool] = ..., resume_version: _Optional[int] = ..., have_chunks: _Optional[_Iterable[int]] = ..., want_delta: _Optional[bool] = ...) -> None: ...

class WatchRequest(_message.Message):
    __slots__ = ("have_version",)
    HAVE_VERSION_FIELD_NUMBER: _ClassVar[int]
    have_version: int
    def __init__(self, have_version: _Optional[int] = ...) -> None: ...

class VersionNotice(_message.Message):
    __slots__ = ("version", "total_bytes", "sha256")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    version: int
    total_bytes: int
    sha256: str
    def __init__(self, version: _Optional[int] = ..., total_bytes: _Optional[int] = ..., sha256: _Optional[str] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class BufferContents(_message.Message):
    __slots__ = ("current_version", "next_step", "prompts", "leased_groups", "ready_groups", "stored_rollouts", "delivered_groups", "delivered_rollouts", "expired_groups", "stale_dropped_groups", "digest")
    CURRENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    NEXT_STEP_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    LEASED_GROUPS_FIELD_NUMBER: _ClassVar[int]
    READY_GROUPS_FIELD_NUMBER: _ClassVar[int]
    STORED_ROLLOUTS_FIELD_NUMBER: _ClassVar[int]
    DELIVERED_GROUPS_FIELD_NUMBER: _ClassVar[int]
    DELIVERED_ROLLOUTS_FIELD_NUMBER: _ClassVar[int]
    EXPIRED_GROUPS_FIELD_NUMBER: _ClassVar[int]
    STALE_DROPPED_GROUPS_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    current_version: int
    next_step: int
    prompts: int
    leased_groups: int
    ready_groups: int
    stored_rollouts: int
    delivered_groups: int
    delivered_rollouts: int
    expired_groups: int
    stale_dropped_groups: int
    digest: str
    def __init__(self, current_version: _Optional[int] = ..., next_step: _Optional[int] = ..., prompts: _Optional[int] = ..., leased_groups: _Optional[int] = ..., ready_groups: _Optional[int] = ..., stored_rollouts: _Optional[int] = ..., delivered_groups: _Optional[int] = ..., delivered_rollouts: _Optional[int] = ..., expired_groups: _Optional[int] = ..., stale_dropped_groups: _Optional[int] = ..., digest: _Optional[str] = ...) -> None: ...

class Status(_message.Message):
    __slots__ = ("contents", "mode", "max_lag", "prompts_per_step", "group_size", "admission_capacity", "lag_total", "recent", "rejected", "bytes_in", "bytes_out")
    class RejectedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    CONTENTS_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    MAX_LAG_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_PER_STEP_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    ADMISSION_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    LAG_TOTAL_FIELD_NUMBER: _ClassVar[int]
    RECENT_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    BYTES_IN_FIELD_NUMBER: _ClassVar[int]
    BYTES_OUT_FIELD_NUMBER: _ClassVar[int]
    contents: BufferContents
    mode: str
    max_lag: int
    prompts_per_step: int
    group_size: int
    admission_capacity: int
    lag_total: LagHistogram
    recent: _containers.RepeatedCompositeFieldContainer[BatchSummary]
    rejected: _containers.ScalarMap[str, int]
    bytes_in: int
    bytes_out: int
    def __init__(self, contents: _Optional[_Union[BufferContents, _Mapping]] = ..., mode: _Optional[str] = ..., max_lag: _Optional[int] = ..., prompts_per_step: _Optional[int] = ..., group_size: _Optional[int] = ..., admission_capacity: _Optional[int] = ..., lag_total: _Optional[_Union[LagHistogram, _Mapping]] = ..., recent: _Optional[_Iterable[_Union[BatchSummary, _Mapping]]] = ..., rejected: _Optional[_Mapping[str, int]] = ..., bytes_in: _Optional[int] = ..., bytes_out: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("generator_id", "version", "group_ids", "lists_groups", "held_versions", "lists_held", "stats", "relay_address", "relay_fanout", "release")
    class StatsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    GENERATOR_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    GROUP_IDS_FIELD_NUMBER: _ClassVar[int]
    LISTS_GROUPS_FIELD_NUMBER: _ClassVar[int]
    HELD_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    LISTS_HELD_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    RELAY_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    RELAY_FANOUT_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    generator_id: str
    version: int
    group_ids: _containers.RepeatedScalarFieldContainer[int]
    lists_groups: bool
    held_versions: _containers.RepeatedScalarFieldContainer[int]
    lists_held: bool
    stats: _containers.ScalarMap[str, float]
    relay_address: str
    relay_fanout: int
    release: bool
    def __init__(self, generator_id: _Optional[str] = ..., version: _Optional[int] = ..., group_ids: _Optional[_Iterable[int]] = ..., lists_groups: _Optional[bool] = ..., held_versions: _Optional[_Iterable[int]] = ..., lists_held: _Optional[bool] = ..., stats: _Optional[_Mapping[str, float]] = ..., relay_address: _Optional[str] = ..., relay_fanout: _Optional[int] = ..., release: _Optional[bool] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("current_version", "leases_extended", "server_time_unix_s", "relay_parents")
    CURRENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    LEASES_EXTENDED_FIELD_NUMBER: _ClassVar[int]
    SERVER_TIME_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    RELAY_PARENTS_FIELD_NUMBER: _ClassVar[int]
    current_version: int
    leases_extended: int
    server_time_unix_s: float
    relay_parents: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, current_version: _Optional[int] = ..., leases_extended: _Optional[int] = ..., server_time_unix_s: _Optional[float] = ..., relay_parents: _Optional[_Iterable[str]] = ...) -> None: ...

class EvalPrompt(_message.Message):
    __slots__ = ("prompt_id", "prompt_tokens", "answer", "task")
    PROMPT_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ANSWER_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    prompt_id: int
    prompt_tokens: Tensor
    answer: str
    task: str
    def __init__(self, prompt_id: _Optional[int] = ..., prompt_tokens: _Optional[_Union[Tensor, _Mapping]] = ..., answer: _Optional[str] = ..., task: _Optional[str] = ...) -> None: ...

class EvalRequest(_message.Message):
    __slots__ = ("eval_id", "version", "samples_per_prompt", "seed", "temperature", "top_p", "prompts")
    EVAL_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_PER_PROMPT_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    eval_id: int
    version: int
    samples_per_prompt: int
    seed: int
    temperature: float
    top_p: float
    prompts: _containers.RepeatedCompositeFieldContainer[EvalPrompt]
    def __init__(self, eval_id: _Optional[int] = ..., version: _Optional[int] = ..., samples_per_prompt: _Optional[int] = ..., seed: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., prompts: _Optional[_Iterable[_Union[EvalPrompt, _Mapping]]] = ...) -> None: ...

class EvalAck(_message.Message):
    __slots__ = ("eval_id", "groups", "duplicate")
    EVAL_ID_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    eval_id: int
    groups: int
    duplicate: bool
    def __init__(self, eval_id: _Optional[int] = ..., groups: _Optional[int] = ..., duplicate: _Optional[bool] = ...) -> None: ...

class EvalGroupResult(_message.Message):
    __slots__ = ("eval_id", "group_id", "prompt_id", "rewards", "lengths", "finish_reasons", "generator_id", "device_seconds", "version")
    EVAL_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_ID_FIELD_NUMBER: _ClassVar[int]
    REWARDS_FIELD_NUMBER: _ClassVar[int]
    LENGTHS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASONS_FIELD_NUMBER: _ClassVar[int]
    GENERATOR_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    eval_id: int
    group_id: int
    prompt_id: int
    rewards: _containers.RepeatedScalarFieldContainer[float]
    lengths: _containers.RepeatedScalarFieldContainer[int]
    finish_reasons: _containers.RepeatedScalarFieldContainer[FinishReason]
    generator_id: str
    device_seconds: float
    version: int
    def __init__(self, eval_id: _Optional[int] = ..., group_id: _Optional[int] = ..., prompt_id: _Optional[int] = ..., rewards: _Optional[_Iterable[float]] = ..., lengths: _Optional[_Iterable[int]] = ..., finish_reasons: _Optional[_Iterable[_Union[FinishReason, str]]] = ..., generator_id: _Optional[str] = ..., device_seconds: _Optional[float] = ..., version: _Optional[int] = ...) -> None: ...

class EvalPushRequest(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[EvalGroupResult]
    def __init__(self, results: _Optional[_Iterable[_Union[EvalGroupResult, _Mapping]]] = ...) -> None: ...

class EvalPushResponse(_message.Message):
    __slots__ = ("accepted", "duplicate")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    accepted: int
    duplicate: int
    def __init__(self, accepted: _Optional[int] = ..., duplicate: _Optional[int] = ...) -> None: ...

class EvalCollectRequest(_message.Message):
    __slots__ = ("eval_id", "timeout_s", "cancel")
    EVAL_ID_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    eval_id: int
    timeout_s: float
    cancel: bool
    def __init__(self, eval_id: _Optional[int] = ..., timeout_s: _Optional[float] = ..., cancel: _Optional[bool] = ...) -> None: ...

class EvalResult(_message.Message):
    __slots__ = ("eval_id", "version", "complete", "pending_groups", "held", "results", "unservable")
    EVAL_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    PENDING_GROUPS_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    UNSERVABLE_FIELD_NUMBER: _ClassVar[int]
    eval_id: int
    version: int
    complete: bool
    pending_groups: int
    held: bool
    results: _containers.RepeatedCompositeFieldContainer[EvalGroupResult]
    unservable: bool
    def __init__(self, eval_id: _Optional[int] = ..., version: _Optional[int] = ..., complete: _Optional[bool] = ..., pending_groups: _Optional[int] = ..., held: _Optional[bool] = ..., results: _Optional[_Iterable[_Union[EvalGroupResult, _Mapping]]] = ..., unservable: _Optional[bool] = ...) -> None: ...
