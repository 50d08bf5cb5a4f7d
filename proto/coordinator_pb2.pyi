from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Verdict(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    VERDICT_UNSPECIFIED: _ClassVar[Verdict]
    VERDICT_PENDING: _ClassVar[Verdict]
    VERDICT_COMMIT: _ClassVar[Verdict]
    VERDICT_RETRY: _ClassVar[Verdict]
    VERDICT_REJOIN: _ClassVar[Verdict]
    VERDICT_STOP: _ClassVar[Verdict]
VERDICT_UNSPECIFIED: Verdict
VERDICT_PENDING: Verdict
VERDICT_COMMIT: Verdict
VERDICT_RETRY: Verdict
VERDICT_REJOIN: Verdict
VERDICT_STOP: Verdict

class Decision(_message.Message):
    __slots__ = ("step", "verdict", "generation", "sites", "reason", "state_source", "state_step", "admitted")
    STEP_FIELD_NUMBER: _ClassVar[int]
    VERDICT_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    SITES_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    STATE_SOURCE_FIELD_NUMBER: _ClassVar[int]
    STATE_STEP_FIELD_NUMBER: _ClassVar[int]
    ADMITTED_FIELD_NUMBER: _ClassVar[int]
    step: int
    verdict: Verdict
    generation: int
    sites: _containers.RepeatedCompositeFieldContainer[SiteInfo]
    reason: str
    state_source: str
    state_step: int
    admitted: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, step: _Optional[int] = ..., verdict: _Optional[_Union[Verdict, str]] = ..., generation: _Optional[int] = ..., sites: _Optional[_Iterable[_Union[SiteInfo, _Mapping]]] = ..., reason: _Optional[str] = ..., state_source: _Optional[str] = ..., state_step: _Optional[int] = ..., admitted: _Optional[_Iterable[str]] = ...) -> None: ...

class CommitStepRequest(_message.Message):
    __slots__ = ("site", "rank", "step", "generation", "ok", "wait_ms", "rank_key", "sites_known")
    SITE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    RANK_KEY_FIELD_NUMBER: _ClassVar[int]
    SITES_KNOWN_FIELD_NUMBER: _ClassVar[int]
    site: str
    rank: int
    step: int
    generation: int
    ok: bool
    wait_ms: int
    rank_key: str
    sites_known: bool
    def __init__(self, site: _Optional[str] = ..., rank: _Optional[int] = ..., step: _Optional[int] = ..., generation: _Optional[int] = ..., ok: _Optional[bool] = ..., wait_ms: _Optional[int] = ..., rank_key: _Optional[str] = ..., sites_known: _Optional[bool] = ...) -> None: ...

class RankBallot(_message.Message):
    __slots__ = ("rank", "ok", "rank_key")
    RANK_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    RANK_KEY_FIELD_NUMBER: _ClassVar[int]
    rank: int
    ok: bool
    rank_key: str
    def __init__(self, rank: _Optional[int] = ..., ok: _Optional[bool] = ..., rank_key: _Optional[str] = ...) -> None: ...

class CommitHostStepRequest(_message.Message):
    __slots__ = ("site", "step", "generation", "ballots", "wait_ms", "sites_known")
    SITE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    BALLOTS_FIELD_NUMBER: _ClassVar[int]
    WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    SITES_KNOWN_FIELD_NUMBER: _ClassVar[int]
    site: str
    step: int
    generation: int
    ballots: _containers.RepeatedCompositeFieldContainer[RankBallot]
    wait_ms: int
    sites_known: bool
    def __init__(self, site: _Optional[str] = ..., step: _Optional[int] = ..., generation: _Optional[int] = ..., ballots: _Optional[_Iterable[_Union[RankBallot, _Mapping]]] = ..., wait_ms: _Optional[int] = ..., sites_known: _Optional[bool] = ...) -> None: ...

class SiteVoteRequest(_message.Message):
    __slots__ = ("site", "step", "generation", "ok", "wait_ms", "suspects")
    SITE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    SUSPECTS_FIELD_NUMBER: _ClassVar[int]
    site: str
    step: int
    generation: int
    ok: bool
    wait_ms: int
    suspects: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, site: _Optional[str] = ..., step: _Optional[int] = ..., generation: _Optional[int] = ..., ok: _Optional[bool] = ..., wait_ms: _Optional[int] = ..., suspects: _Optional[_Iterable[str]] = ...) -> None: ...

class ProposeRequest(_message.Message):
    __slots__ = ("leader", "generation", "sites", "start_step", "state_source")
    LEADER_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    SITES_FIELD_NUMBER: _ClassVar[int]
    START_STEP_FIELD_NUMBER: _ClassVar[int]
    STATE_SOURCE_FIELD_NUMBER: _ClassVar[int]
    leader: str
    generation: int
    sites: _containers.RepeatedCompositeFieldContainer[SiteInfo]
    start_step: int
    state_source: str
    def __init__(self, leader: _Optional[str] = ..., generation: _Optional[int] = ..., sites: _Optional[_Iterable[_Union[SiteInfo, _Mapping]]] = ..., start_step: _Optional[int] = ..., state_source: _Optional[str] = ...) -> None: ...

class ProposeResponse(_message.Message):
    __slots__ = ("accepted", "generation", "committed_steps")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_STEPS_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    generation: int
    committed_steps: int
    def __init__(self, accepted: _Optional[bool] = ..., generation: _Optional[int] = ..., committed_steps: _Optional[int] = ...) -> None: ...

class JobFingerprint(_message.Message):
    __slots__ = ("fields",)
    class FieldsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    FIELDS_FIELD_NUMBER: _ClassVar[int]
    fields: _containers.ScalarMap[str, str]
    def __init__(self, fields: _Optional[_Mapping[str, str]] = ...) -> None: ...

class SiteInfo(_message.Message):
    __slots__ = ("name", "index", "lane_addresses", "coordinator_address")
    NAME_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    LANE_ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    name: str
    index: int
    lane_addresses: _containers.RepeatedScalarFieldContainer[str]
    coordinator_address: str
    def __init__(self, name: _Optional[str] = ..., index: _Optional[int] = ..., lane_addresses: _Optional[_Iterable[str]] = ..., coordinator_address: _Optional[str] = ...) -> None: ...

class RegisterRankRequest(_message.Message):
    __slots__ = ("site", "rank", "world_size", "lane_address", "fingerprint", "rank_key")
    SITE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    LANE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    RANK_KEY_FIELD_NUMBER: _ClassVar[int]
    site: str
    rank: int
    world_size: int
    lane_address: str
    fingerprint: JobFingerprint
    rank_key: str
    def __init__(self, site: _Optional[str] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., lane_address: _Optional[str] = ..., fingerprint: _Optional[_Union[JobFingerprint, _Mapping]] = ..., rank_key: _Optional[str] = ...) -> None: ...

class RegisterRankResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AbortJobRequest(_message.Message):
    __slots__ = ("site", "rank", "rank_key", "reason")
    SITE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    RANK_KEY_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    site: str
    rank: int
    rank_key: str
    reason: str
    def __init__(self, site: _Optional[str] = ..., rank: _Optional[int] = ..., rank_key: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class AbortJobResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class JoinRequest(_message.Message):
    __slots__ = ("site", "fingerprint", "ready", "generation", "incarnation")
    SITE_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    site: SiteInfo
    fingerprint: JobFingerprint
    ready: bool
    generation: int
    incarnation: str
    def __init__(self, site: _Optional[_Union[SiteInfo, _Mapping]] = ..., fingerprint: _Optional[_Union[JobFingerprint, _Mapping]] = ..., ready: _Optional[bool] = ..., generation: _Optional[int] = ..., incarnation: _Optional[str] = ...) -> None: ...

class JoinResponse(_message.Message):
    __slots__ = ("site", "ready", "generation", "incarnation", "aborted")
    SITE_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    site: SiteInfo
    ready: bool
    generation: int
    incarnation: str
    aborted: str
    def __init__(self, site: _Optional[_Union[SiteInfo, _Mapping]] = ..., ready: _Optional[bool] = ..., generation: _Optional[int] = ..., incarnation: _Optional[str] = ..., aborted: _Optional[str] = ...) -> None: ...

class GetMembershipRequest(_message.Message):
    __slots__ = ("known_generation", "wait_ms", "rank_key", "vouched_rank_keys")
    KNOWN_GENERATION_FIELD_NUMBER: _ClassVar[int]
    WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    RANK_KEY_FIELD_NUMBER: _ClassVar[int]
    VOUCHED_RANK_KEYS_FIELD_NUMBER: _ClassVar[int]
    known_generation: int
    wait_ms: int
    rank_key: str
    vouched_rank_keys: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, known_generation: _Optional[int] = ..., wait_ms: _Optional[int] = ..., rank_key: _Optional[str] = ..., vouched_rank_keys: _Optional[_Iterable[str]] = ...) -> None: ...

class GetMembershipResponse(_message.Message):
    __slots__ = ("generation", "sites", "start_step", "state_source", "suspects")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    SITES_FIELD_NUMBER: _ClassVar[int]
    START_STEP_FIELD_NUMBER: _ClassVar[int]
    STATE_SOURCE_FIELD_NUMBER: _ClassVar[int]
    SUSPECTS_FIELD_NUMBER: _ClassVar[int]
    generation: int
    sites: _containers.RepeatedCompositeFieldContainer[SiteInfo]
    start_step: int
    state_source: str
    suspects: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, generation: _Optional[int] = ..., sites: _Optional[_Iterable[_Union[SiteInfo, _Mapping]]] = ..., start_step: _Optional[int] = ..., state_source: _Optional[str] = ..., suspects: _Optional[_Iterable[str]] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("site", "step", "digest", "digest_step", "finished", "generation", "confirm_digest", "confirm_step", "confirm_generation")
    SITE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    DIGEST_STEP_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    CONFIRM_DIGEST_FIELD_NUMBER: _ClassVar[int]
    CONFIRM_STEP_FIELD_NUMBER: _ClassVar[int]
    CONFIRM_GENERATION_FIELD_NUMBER: _ClassVar[int]
    site: str
    step: int
    digest: str
    digest_step: int
    finished: bool
    generation: int
    confirm_digest: bool
    confirm_step: int
    confirm_generation: int
    def __init__(self, site: _Optional[str] = ..., step: _Optional[int] = ..., digest: _Optional[str] = ..., digest_step: _Optional[int] = ..., finished: _Optional[bool] = ..., generation: _Optional[int] = ..., confirm_digest: _Optional[bool] = ..., confirm_step: _Optional[int] = ..., confirm_generation: _Optional[int] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("generation", "member", "incarnation", "confirmed_digest", "site", "ready", "proposed_members", "aborted", "step", "finished", "model_layout")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    MEMBER_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    CONFIRMED_DIGEST_FIELD_NUMBER: _ClassVar[int]
    SITE_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    PROPOSED_MEMBERS_FIELD_NUMBER: _ClassVar[int]
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    MODEL_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    generation: int
    member: bool
    incarnation: str
    confirmed_digest: str
    site: SiteInfo
    ready: bool
    proposed_members: _containers.RepeatedScalarFieldContainer[str]
    aborted: str
    step: int
    finished: bool
    model_layout: str
    def __init__(self, generation: _Optional[int] = ..., member: _Optional[bool] = ..., incarnation: _Optional[str] = ..., confirmed_digest: _Optional[str] = ..., site: _Optional[_Union[SiteInfo, _Mapping]] = ..., ready: _Optional[bool] = ..., proposed_members: _Optional[_Iterable[str]] = ..., aborted: _Optional[str] = ..., step: _Optional[int] = ..., finished: _Optional[bool] = ..., model_layout: _Optional[str] = ...) -> None: ...

class ReportProgressRequest(_message.Message):
    __slots__ = ("site", "step", "loss", "step_s", "compute_s", "cross_site_s", "tokens", "cross_site_bytes", "raw_bytes", "mfu", "digest", "digest_step", "finished", "sync_busy_s", "rank_key", "model_layout", "script_metrics", "links")
    class ScriptMetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    SITE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    STEP_S_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    CROSS_SITE_S_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    CROSS_SITE_BYTES_FIELD_NUMBER: _ClassVar[int]
    RAW_BYTES_FIELD_NUMBER: _ClassVar[int]
    MFU_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    DIGEST_STEP_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    SYNC_BUSY_S_FIELD_NUMBER: _ClassVar[int]
    RANK_KEY_FIELD_NUMBER: _ClassVar[int]
    MODEL_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    SCRIPT_METRICS_FIELD_NUMBER: _ClassVar[int]
    LINKS_FIELD_NUMBER: _ClassVar[int]
    site: str
    step: int
    loss: float
    step_s: float
    compute_s: float
    cross_site_s: float
    tokens: int
    cross_site_bytes: int
    raw_bytes: int
    mfu: float
    digest: str
    digest_step: int
    finished: bool
    sync_busy_s: float
    rank_key: str
    model_layout: str
    script_metrics: _containers.ScalarMap[str, float]
    links: _containers.RepeatedCompositeFieldContainer[LinkFigures]
    def __init__(self, site: _Optional[str] = ..., step: _Optional[int] = ..., loss: _Optional[float] = ..., step_s: _Optional[float] = ..., compute_s: _Optional[float] = ..., cross_site_s: _Optional[float] = ..., tokens: _Optional[int] = ..., cross_site_bytes: _Optional[int] = ..., raw_bytes: _Optional[int] = ..., mfu: _Optional[float] = ..., digest: _Optional[str] = ..., digest_step: _Optional[int] = ..., finished: _Optional[bool] = ..., sync_busy_s: _Optional[float] = ..., rank_key: _Optional[str] = ..., model_layout: _Optional[str] = ..., script_metrics: _Optional[_Mapping[str, float]] = ..., links: _Optional[_Iterable[_Union[LinkFigures, _Mapping]]] = ...) -> None: ...

class LinkFigures(_message.Message):
    __slots__ = ("peer", "bytes", "wire_s", "rate_bps", "line_share", "rtt_s", "min_rtt_s", "cwnd_bytes", "retransmits")
    PEER_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    WIRE_S_FIELD_NUMBER: _ClassVar[int]
    RATE_BPS_FIELD_NUMBER: _ClassVar[int]
    LINE_SHARE_FIELD_NUMBER: _ClassVar[int]
    RTT_S_FIELD_NUMBER: _ClassVar[int]
    MIN_RTT_S_FIELD_NUMBER: _ClassVar[int]
    CWND_BYTES_FIELD_NUMBER: _ClassVar[int]
    RETRANSMITS_FIELD_NUMBER: _ClassVar[int]
    peer: str
    bytes: int
    wire_s: float
    rate_bps: float
    line_share: float
    rtt_s: float
    min_rtt_s: float
    cwnd_bytes: int
    retransmits: int
    def __init__(self, peer: _Optional[str] = ..., bytes: _Optional[int] = ..., wire_s: _Optional[float] = ..., rate_bps: _Optional[float] = ..., line_share: _Optional[float] = ..., rtt_s: _Optional[float] = ..., min_rtt_s: _Optional[float] = ..., cwnd_bytes: _Optional[int] = ..., retransmits: _Optional[int] = ...) -> None: ...

class ReportProgressResponse(_message.Message):
    __slots__ = ("divergence", "agreed")
    DIVERGENCE_FIELD_NUMBER: _ClassVar[int]
    AGREED_FIELD_NUMBER: _ClassVar[int]
    divergence: str
    agreed: bool
    def __init__(self, divergence: _Optional[str] = ..., agreed: _Optional[bool] = ...) -> None: ...

class WitnessPingRequest(_message.Message):
    __slots__ = ("site", "fingerprint")
    SITE_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    site: str
    fingerprint: JobFingerprint
    def __init__(self, site: _Optional[str] = ..., fingerprint: _Optional[_Union[JobFingerprint, _Mapping]] = ...) -> None: ...

class WitnessPingResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WitnessGrantRequest(_message.Message):
    __slots__ = ("site", "members", "fingerprint")
    SITE_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    site: str
    members: _containers.RepeatedScalarFieldContainer[str]
    fingerprint: JobFingerprint
    def __init__(self, site: _Optional[str] = ..., members: _Optional[_Iterable[str]] = ..., fingerprint: _Optional[_Union[JobFingerprint, _Mapping]] = ...) -> None: ...

class WitnessGrantResponse(_message.Message):
    __slots__ = ("granted", "reason", "holder")
    GRANTED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    HOLDER_FIELD_NUMBER: _ClassVar[int]
    granted: bool
    reason: str
    holder: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, granted: _Optional[bool] = ..., reason: _Optional[str] = ..., holder: _Optional[_Iterable[str]] = ...) -> None: ...
