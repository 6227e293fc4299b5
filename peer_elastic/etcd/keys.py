"""The key layout of one job in etcd.

```
/peer-elastic/<job>/run                         RunRecord (run lease)
/peer-elastic/<job>/<run>/members/<member>      MemberRecord (member lease)
/peer-elastic/<job>/<run>/generation            GenerationRecord (run lease; CAS by the leader)
/peer-elastic/<job>/<run>/gen/<n>/ready/<m>     AckRecord (member lease)
/peer-elastic/<job>/<run>/gen/<n>/broken/<m>    AckRecord (member lease)
/peer-elastic/<job>/<run>/gen/<n>/alive/<m>     AckRecord (member lease): "n broke, I live"
/peer-elastic/<job>/<run>/gen/<n>/store/...     torch Store keys (run lease)
/peer-elastic/<job>/<run>/drain/<member>        DrainRecord (run lease)
/peer-elastic/<job>/<run>/fenced/<member>       FenceRecord (run lease): it took itself out
/peer-elastic/<job>/<run>/failures/<host>       HostRecord (run lease)
/peer-elastic/<job>/<run>/blacklist/<host>      HostRecord (cooldown lease)
/peer-elastic/<job>/<run>/progress              ProgressRecord (run lease)
/peer-elastic/<job>/<run>/events/<ns>-<member>    EventRecord (run lease)
/peer-elastic/<job>/<run>/done                  DoneRecord (run lease)
```

Everything but ``run`` lives under the run id, and every key is attached to a lease, so a
finished or abandoned run disappears ``run_ttl`` after its last peer and the job name can
be used again without colliding with stale keys.
"""

from __future__ import annotations

from dataclasses import dataclass

from peer_elastic.errors import ConfigError
from peer_elastic.records import valid_name

ROOT = "/peer-elastic/"


def job_prefix(job: str) -> str:
    if not valid_name(job):
        raise ConfigError(
            f"invalid job name {job!r}: use 1-128 characters from [A-Za-z0-9_.-], "
            "starting with a letter or digit"
        )
    return f"{ROOT}{job}/"


@dataclass(frozen=True)
class RunKeys:
    """Keys of one run of one job."""

    job: str
    run_id: str

    @property
    def job_prefix(self) -> str:
        return job_prefix(self.job)

    @property
    def run_key(self) -> str:
        return self.job_prefix + "run"

    @property
    def prefix(self) -> str:
        return f"{self.job_prefix}{self.run_id}/"

    def member(self, member_id: str) -> str:
        return f"{self.prefix}members/{member_id}"

    @property
    def generation(self) -> str:
        return self.prefix + "generation"

    def gen_prefix(self, n: int) -> str:
        return f"{self.prefix}gen/{n}/"

    def ready(self, n: int, member_id: str) -> str:
        return f"{self.gen_prefix(n)}ready/{member_id}"

    def broken(self, n: int, member_id: str) -> str:
        return f"{self.gen_prefix(n)}broken/{member_id}"

    def alive(self, n: int, member_id: str) -> str:
        return f"{self.gen_prefix(n)}alive/{member_id}"

    def store_prefix(self, n: int) -> str:
        return f"{self.gen_prefix(n)}store/"

    def drain(self, member_id: str) -> str:
        return f"{self.prefix}drain/{member_id}"

    def fenced(self, member_id: str) -> str:
        return f"{self.prefix}fenced/{member_id}"

    def failures(self, host: str) -> str:
        return f"{self.prefix}failures/{host}"

    def blacklist(self, host: str) -> str:
        return f"{self.prefix}blacklist/{host}"

    @property
    def progress(self) -> str:
        return self.prefix + "progress"

    @property
    def done(self) -> str:
        return self.prefix + "done"

    def event(self, seq: str) -> str:
        """Event keys sort by time: ``seq`` is a zero-padded nanosecond stamp plus the writer."""
        return f"{self.prefix}events/{seq}"

    @property
    def events_prefix(self) -> str:
        return self.prefix + "events/"
