"""What one copy of a datastore knows of one application (multiple-copy delivery): its
serving claim, whether this copy serves it or could, and where the shared datamarkers map
into this copy's publisher log. :class:`wormhole.core.copies.CopyCoordinator` keeps one
per application.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from wormhole.core.copy_positions import Version
from wormhole.plugins.components import ServingClaim, SharedDatamarker

CLAIM_GRACE_S = 2.0
"""How long each less preferred copy waits, per rank, before claiming a free application."""
UNREACHED_S = 2.0
"""How long a copy may have none of an application's registered subscribers connected before
it counts as one they cannot reach (a subscriber starting connects well within it)."""


@dataclass
class CopyState:
    name: str
    claim: ServingClaim | None = None
    """The serving claim as the registry last showed it."""
    epoch: int = 0
    """The epoch of this copy's claim (0: this copy does not serve it)."""
    free_since: float | None = None
    """Since when no copy holds the claim (monotonic; see :meth:`free`)."""
    claim_seen: float | None = None
    """When the current claim (another copy's or this one's) was first seen."""
    free_before: float | None = None
    """``free_since`` before the current claim: restored if the claim goes without serving."""
    seen_epoch: int = 0
    """The epoch of the claim seen last."""
    handing_over: float | None = None
    """When this copy started giving the application back (failback, move)."""
    settled_at: float | None = None
    """Handing over: when its subscribers had let go (the final datamarkers are shared)."""
    behind_since: float | None = None
    """Since when it has been this copy's turn to claim while it could not serve."""
    reported: str = ""
    warned: bool = False
    """This copy said (once) why it does not claim the application it is its turn to serve."""
    overdue: bool = False
    """It reported that it waited ``delivery.catch_up_ms`` in vain (once per wait)."""
    why: str = ""
    """Standby: why it is not ready (its log is behind, or no longer holds, a shared
    datamarker's update)."""
    behind: bool = False
    """Standby: not ready because its log is behind (it may catch up)."""
    scanned: tuple[int, Version] | None = None
    """Standby: where its last scan of its log for unmapped shared datamarkers ended (the
    seq, and the version before it)."""
    refused_until: float = 0.0
    """It gave a claim back without serving: no claim before this (monotonic) time."""
    saved: dict[int, SharedDatamarker] = field(default_factory=dict)
    mapped: dict[int, tuple[Version, int]] = field(default_factory=dict)
    """Each shard's shared datamarker version and where it maps in this log: the seq after
    the update it names (standby: as followed; serving: as taken over and shared)."""
    loaded: bool = False
    """The shared datamarkers were read since this copy started: until then, retention
    keeps the whole log (:meth:`CopyPositions.retained`)."""
    ready: bool = False
    """Standby: every shared datamarker maps into this copy's log (it can take over now)."""
    claimed_ms: int = 0
    """When this copy's claim was made (wall clock): a move requested later applies to it."""
    waiting_for: str = ""
    """The copy this serving copy would hand over to but which is not ready (logged once)."""
    shared_at: list[tuple[float, Version]] = field(default_factory=list)
    """Serving: the newest version its shared datamarkers reached, and when (monotonic), over
    the last seconds (:meth:`CopyPositions.needed`)."""
    unreached_since: float | None = None
    """Since when the registry has listed subscribers of the application while none was
    connected to this copy (monotonic; None while one is, or none is listed)."""
    """The copy this serving copy would hand over to but which is not ready (logged once)."""

    def free(self, claim: ServingClaim | None, now: float) -> None:
        """The claim is now ``claim``: track since when the application has been free. A
        claim given back within the grace period (a copy that claimed and could not serve)
        does not count as held: the less preferred copies' wait goes on from before it, so
        claims that come and go do not hold them off."""
        if claim is not None:
            if self.claim_seen is None:
                self.claim_seen, self.free_before = now, self.free_since
            elif claim.epoch != self.seen_epoch:
                # Another claim, the end of the one before unseen: that one counted as held
                # if it lasted the grace period.
                if now - self.claim_seen >= CLAIM_GRACE_S:
                    self.free_before = None
                self.claim_seen = now
            self.seen_epoch = claim.epoch
            self.free_since = None
            return
        if self.free_since is None:
            brief = self.claim_seen is not None and now - self.claim_seen < CLAIM_GRACE_S
            self.free_since = self.free_before if brief and self.free_before else now
        self.claim_seen = self.free_before = None


__all__ = ["CLAIM_GRACE_S", "UNREACHED_S", "CopyState"]
