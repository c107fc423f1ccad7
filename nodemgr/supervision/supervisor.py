"""Keeps every card in its mode: shared cards run MPS, whole cards leave it.

A shared card's control daemon runs (started, or adopted when one answers at its pipe
directory), compute mode is EXCLUSIVE_PROCESS and the server-side pinned memory ceiling
is set (a client without env is still bounded). A daemon down is restarted with backoff
(1 s doubling to 60 s); while it is down, hung, broken or in FAULT, or answers but
cannot be verified (mps.identity: its servers could not be told from tenants'), the
card's shared devices are Unhealthy. A card given out whole leaves MPS once its daemon
has no clients (compute mode DEFAULT); freed, it returns. ``mps_servers`` gives the
watchdog the verified daemons' servers, the only GPU processes outside containers it
spares.

The thread sleeps until a card changes state, a verified daemon exits (a pidfd each)
or a health check is due. A check re-verifies the known daemon alone and, at most
every ``DEFAULTS_CHECK_SECONDS``, reads the daemon's defaults back: any tenant may set
them through the unprivileged socket, so a change is restored and logged.

Each card has its own /dev/shm tmpfs (mps.shm), its control daemon's and MPS servers'
alone (no container gets it): the daemon starts in a namespace where /dev/shm is that
tmpfs (mps.namespace). A daemon found on the host's /dev/shm is replaced once it has no
clients. A card holding no shared allocation has its tmpfs emptied under the allocator's
lock, after an idle MPS server is stopped with its daemon (what it left is there). Without root the
daemons keep our /dev/shm and the cards' directories are plain ones (said once).

A control daemon serves one client at a time and waits on it with no time-out, so a
silent client hangs MPS on the card for every tenant. While a card does not answer,
each hung check looks at the daemon's connections (mps.connections); a client waited
on at two checks in a row is a hold (mps.holders), named in the card's problem and
handed to the watchdog (``control_holds``). The supervisor itself never kills.

Stopping leaves every control daemon running: they and their clients outlive a restart
or upgrade of gpushare-node.

Longer than 400 lines: one thread drives each card's mode, daemon, tmpfs and holds.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import psutil

from mps import CardDaemon, DaemonIdentity, Health, HealthState, MpsError, MpsLayout, proc, shm
from mps.control import shown_pinned_limit_mib
from mps.holders import Look, holding, waiting
from mps.mounts import MountError
from mps.namespace import CardNamespace, prepare_directory
from nodemgr.allocation.allocator import Allocator
from nodemgr.common.wakepipe import WakePipe
from nodemgr.common.workers import ThreadWorker
from nodemgr.config.schema import MpsSettings
from nodemgr.domain.statusdoc import MpsView
from nodemgr.domain.violations import ControlHold
from nodemgr.errors import InventoryError
from nodemgr.inventory import Card, Inventory

log = logging.getLogger(__name__)

BACKOFF_MAX_SECONDS = 60.0
# Two control commands per card.
DEFAULTS_CHECK_SECONDS = 60.0
DEFAULT_THREAD_PERCENT = 100.0  # no server-side share: each client's env sets its own
MIN_SHM_MIB = 64  # a container runtime's default


def card_shm_mib(setting_mib: int, memory_bytes: int, cards: int) -> int:
    """``mps.shm_size_mib``, or for 0 half of the memory shared out among the cards, at
    least MIN_SHM_MIB (a tmpfs takes memory only for what is written in it)."""
    if setting_mib:
        return setting_mib
    return max(MIN_SHM_MIB, memory_bytes // 2 // max(1, cards) // 2**20)


def card_daemon(settings: MpsSettings, layout: MpsLayout, uuid: str, isolate: bool) -> CardDaemon:
    """With ``isolate``: started in the card's mount namespace."""
    namespace = None
    if isolate:
        timeout = settings.command_timeout_seconds
        namespace = CardNamespace(layout.namespace_file(uuid), layout.shm_dir(uuid), timeout)
    return CardDaemon(
        uuid,
        settings.control_binary,
        layout.pipe_dir(uuid),
        layout.log_dir(uuid),
        settings.command_timeout_seconds,
        layout.client_dir(uuid),
        namespace,
    )


def start_card_daemon(settings: MpsSettings, layout: MpsLayout, uuid: str, cards: int) -> int:
    """As the supervisor does (``nodemgr mps-start``, run by a ``gpushare-mps@`` unit):
    in the card's namespace on its tmpfs, made first. Its PID; a daemon already
    answering is left alone."""
    isolate = os.geteuid() == 0
    if isolate:
        prepare_directory(layout.namespace_dir)
        size_mib = card_shm_mib(settings.shm_size_mib, psutil.virtual_memory().total, cards)
        shm.mount(layout.shm_dir(uuid), size_mib)
    daemon = card_daemon(settings, layout, uuid, isolate)
    if daemon.probe().state is not HealthState.DOWN:
        raise MpsError(f"an MPS control daemon already answers at {daemon.pipe_dir}")
    daemon.start()
    daemon.publish()
    pid = daemon.pid()
    if pid is None:
        raise MpsError(f"the MPS control daemon started at {daemon.pipe_dir} cannot be verified")
    return pid


@dataclass
class _CardState:
    daemon: CardDaemon
    mode: str | None = None  # "shared" or "whole" once reached
    # Where the ceilings were set. Read by the watchdog thread: replaced whole.
    identity: DaemonIdentity | None = None
    failures: int = 0
    retry_at: float = 0.0  # monotonic; no restart before this
    problem: str | None = None
    health: Health | None = None
    notes: set[str] = field(default_factory=set)  # said once until the situation changes
    watched: tuple[DaemonIdentity, int] | None = None  # with its pidfd
    defaults_checked_at: float = 0.0  # monotonic
    shm_problem: str | None = None
    # While the card does not answer: the last hung check's look, whether to look again
    # at once, the holds found (read by the watchdog's thread: replaced whole).
    look: Look | None = None
    relook: bool = False
    holds: tuple[ControlHold, ...] = ()


class MpsSupervisor(ThreadWorker):
    def __init__(
        self,
        settings: MpsSettings,
        layout: MpsLayout,
        inventory: Inventory,
        allocator: Allocator,
        memory_unit_mib: int,
        isolate_shm: bool | None = None,
    ):
        """``isolate_shm`` (needs root) None: when running as root."""
        super().__init__("mps-supervisor")
        self._settings = settings
        self._layout = layout
        self._inventory = inventory
        self._allocator = allocator
        self._unit_mib = memory_unit_mib
        self._isolate = os.geteuid() == 0 if isolate_shm is None else isolate_shm
        self._shm_mib = card_shm_mib(
            settings.shm_size_mib, psutil.virtual_memory().total, len(allocator.cards)
        )
        self._cards = {card.uuid: card for card in allocator.cards}
        self._states = {
            card.uuid: _CardState(card_daemon(settings, layout, card.uuid, self._isolate))
            for card in allocator.cards
        }
        self._wake_pipe = WakePipe()  # card changes and stop(); never closed

    def mps_servers(self) -> frozenset[tuple[int, int]]:
        """Read now, from the watchdog's thread; an unreadable process is not in."""
        servers: set[tuple[int, int]] = set()
        for state in list(self._states.values()):
            identity = state.identity
            if identity is not None:
                servers |= state.daemon.servers(identity)
        return frozenset(servers)

    def control_holds(self) -> tuple[ControlHold, ...]:
        """As the last hung checks found them; from the watchdog's thread."""
        holds: list[ControlHold] = []
        for state in list(self._states.values()):
            holds.extend(state.holds)
        return tuple(holds)

    def prepare(self) -> None:
        """Once at start, before serving: every card at once."""
        self._prepare_shm()
        whole, shared = self._allocator.whole_cards(), self._allocator.shared_cards()
        with ThreadPoolExecutor(max(1, len(self._states)), "mps-prepare") as pool:
            list(pool.map(lambda uuid: self._tend(uuid, whole, shared, True), list(self._states)))

    def run(self, stop: threading.Event) -> None:
        changes = self._allocator.card_changes
        changes.add_listener(self._poke)
        try:
            next_check = time.monotonic() + self._settings.health_check_interval_seconds
            while not stop.is_set():
                died = self._wait(self._next_wake(next_check) - time.monotonic())
                if stop.is_set():
                    break
                check = time.monotonic() >= next_check
                self.tend_all(check=check, died=died)
                if check:
                    next_check = time.monotonic() + self._settings.health_check_interval_seconds
        finally:
            changes.remove_listener(self._poke)
            for state in self._states.values():
                self._unwatch(state)

    def _poke(self) -> None:
        self._wake_pipe.wake()

    def _wake(self) -> None:
        self._poke()

    def _next_wake(self, next_check: float) -> float:
        if any(s.relook for s in self._states.values()):
            return time.monotonic()
        retries = [s.retry_at for s in self._states.values() if s.failures and s.retry_at]
        return min([next_check, *retries])

    def _wait(self, timeout: float) -> set[str]:
        """The cards whose daemon exited."""
        watched = {s.watched[1]: uuid for uuid, s in self._states.items() if s.watched}
        try:
            wake = self._wake_pipe.fileno()
            ready, _, _ = select.select([wake, *watched], [], [], max(0.0, timeout))
        except (OSError, ValueError):  # a pidfd closed under us: check everything now
            return set(self._states)
        if wake in ready:
            self._wake_pipe.drain()
        return {watched[fd] for fd in ready if fd in watched}

    def tend_all(self, check: bool = True, died: set[str] | frozenset[str] = frozenset()) -> None:
        """``check``: ask every control daemon; otherwise only the cards that changed state
        or whose daemon exited."""
        whole, shared = self._allocator.whole_cards(), self._allocator.shared_cards()
        for uuid in self._states:
            if self.stopping:  # a stop waits for at most the one command in flight
                return
            self._tend(uuid, whole, shared, check or uuid in died)

    def _tend(self, uuid: str, whole: set[str], shared: set[str], check: bool) -> None:
        card, state = self._cards[uuid], self._states[uuid]
        try:
            if uuid in whole:
                self._leave_mps(card, state)
            elif check or state.mode != "shared" or state.problem or state.failures:
                self._keep_mps(card, state)
            if uuid not in shared and _has_entries(self._layout.shm_dir(uuid)):
                self._empty_shm(card, state, uuid in whole)
        except Exception:  # one card's surprise must not stop the others' care
            log.exception("GPU%d: MPS supervision failed", card.index)

    def set_settings(self, settings: MpsSettings) -> None:
        self._settings = settings

    def views(self) -> dict[str, MpsView]:
        views = {}
        for uuid, state in self._states.items():
            health = state.health
            if state.mode == "whole":
                views[uuid] = MpsView("off", None, "card given out whole: MPS stopped")
            elif health is None:
                views[uuid] = MpsView("starting", None, "not probed yet")
            else:
                views[uuid] = MpsView(health.state.value, health.clients, health.reason)
        return views

    def _keep_mps(self, card: Card, state: _CardState, replaced: bool = False) -> None:
        state.relook = False
        if self._without_shm(card, state):
            return
        health = self._probe(card, state)
        if health.state is HealthState.DOWN and state.mode == "shared" and not state.failures:
            # It was running: tell kubelet first, restart after the backoff.
            self._problem(card, state, health)
            self._schedule_retry(state)
            return
        if health.state is HealthState.DOWN:
            if time.monotonic() < state.retry_at:
                return
            health = state.health = self._start(card, state, health)
        elif state.mode is None and health.ok:
            log.info(
                "GPU%d: adopted the running MPS control daemon (pid %s, %d clients)",
                card.index,
                state.daemon.pid(),
                health.clients,
            )
        if not health.ok:
            self._problem(card, state, health)
            return
        identity = state.daemon.identify(state.identity)
        if identity is None:
            state.identity = None  # its servers are exempt no longer
            self._unverified(card, state)
            return
        if self._outside_card_shm(card, state, identity, health, replaced):
            return
        try:
            state.daemon.publish()
        except MpsError as e:
            self._problem(card, state, Health(HealthState.BROKEN, str(e)))
            return
        self._watch(state, identity)
        if state.identity == identity and state.mode == "shared":
            self._check_defaults(card, state)
        if not self._set_up(card, state, identity):
            return
        state.mode, state.failures, state.retry_at = "shared", 0, 0.0
        self._set_problem(card, state, None)

    def _probe(self, card: Card, state: _CardState) -> Health:
        health = state.health = state.daemon.probe()
        if health.state is HealthState.HUNG:
            health = state.health = self._find_holders(card, state, health)
        else:
            state.look, state.holds = None, ()
            state.notes = {n for n in state.notes if not n.startswith(("hold-", "look-"))}
        return health

    def _without_shm(self, card: Card, state: _CardState) -> bool:
        """Without its tmpfs (tried again now) no shared work: its control daemon and MPS
        server would have a directory of the host's run_dir as /dev/shm."""
        if state.shm_problem is None or self._mount_shm(card, state):
            return False
        reason = f"no /dev/shm tmpfs for its MPS control daemon: {state.shm_problem}"
        self._problem(card, state, Health(HealthState.BROKEN, reason), "no /dev/shm tmpfs")
        return True

    def _set_up(self, card: Card, state: _CardState, identity: DaemonIdentity) -> bool:
        """False when that failed (the card's problem)."""
        if state.identity == identity and state.mode == "shared":
            return True
        try:
            self._inventory.set_compute_mode(card.uuid, "EXCLUSIVE_PROCESS")
            shareable_mib = self._shareable_mib(card)
            # Ordinal 0: the daemon sees only this card (CUDA_VISIBLE_DEVICES).
            state.daemon.client.set_default_pinned_mem_limit("0", shareable_mib)
        except (InventoryError, MpsError) as e:
            self._problem(card, state, Health(HealthState.BROKEN, str(e)))
            return False
        state.identity = identity
        state.defaults_checked_at = time.monotonic()  # just set
        log.info(
            "GPU%d: MPS ready (control daemon pid %d, compute mode EXCLUSIVE_PROCESS, "
            "pinned memory ceiling %d MiB)",
            card.index,
            identity.pid,
            shareable_mib,
        )
        return True

    def _outside_card_shm(
        self,
        card: Card,
        state: _CardState,
        identity: DaemonIdentity,
        health: Health,
        replaced: bool,
    ) -> bool:
        """True when the daemon is off the card's tmpfs and that was dealt with (replaced,
        or the card's problem); False when it is on it, or serves clients on."""
        if state.daemon.on_card_shm(identity) is not False:
            return False
        if replaced:
            reason = (
                f"the MPS control daemon started in its namespace (pid {identity.pid}) does "
                f"not have the card's tmpfs {self._layout.shm_dir(card.uuid)} as /dev/shm"
            )
            self._problem(card, state, Health(HealthState.BROKEN, reason))
            return True
        if not self._replace_outside(card, state, identity, health):
            return False
        self._keep_mps(card, state, replaced=True)
        return True

    def _replace_outside(
        self, card: Card, state: _CardState, identity: DaemonIdentity, health: Health
    ) -> bool:
        """Quit it once it has no clients, for one in the card's namespace. True once quit."""
        if health.clients:
            self._note(
                state,
                f"outside-{identity.pid}",
                logging.WARNING,
                "GPU%d: its MPS control daemon (pid %d) runs with the host's /dev/shm, not "
                "the card's tmpfs %s (started by an earlier gpushare-node or by hand); it "
                "serves its %d clients on and is replaced once they exit",
                card.index,
                identity.pid,
                self._layout.shm_dir(card.uuid),
                health.clients,
            )
            return False
        log.warning(
            "GPU%d: its MPS control daemon (pid %d) runs with the host's /dev/shm and has no "
            "clients: replacing it with one whose /dev/shm is the card's tmpfs %s",
            card.index,
            identity.pid,
            self._layout.shm_dir(card.uuid),
        )
        try:
            state.daemon.stop()
        except MpsError as e:
            self._problem(card, state, Health(HealthState.BROKEN, str(e)))
            return False
        self._unwatch(state)
        state.identity, state.mode, state.failures, state.retry_at = None, None, 0, 0.0
        return True

    def _find_holders(self, card: Card, state: _CardState, hung: Health) -> Health:
        """The hung health, its reason naming what holds the daemon (see the module)."""
        identity = state.daemon.identify(state.identity)
        if identity is None:
            state.look, state.holds = None, ()
            return hung
        look = state.daemon.look(identity, os.getpid())
        held = holding(state.look, look)
        state.look = look
        state.holds = tuple(
            ControlHold(
                card.uuid, c.inode, c.peer or 0, tuple((h.pid, h.start_ticks) for h in c.holders)
            )
            for c in held
        )
        if look.problem is not None:
            self._note(
                state,
                "look-failed",
                logging.WARNING,
                "GPU%d: its MPS control daemon does not answer, and which client it waits "
                "on cannot be told: %s",
                card.index,
                look.problem,
            )
            return hung
        candidates = waiting(look)
        state.relook = bool(candidates) and not held
        if not candidates:
            return hung
        pids = ", ".join(str(h.pid) for c in candidates for h in c.holders)
        if held:
            for hold in state.holds:
                self._note(
                    state,
                    f"hold-{hold.connection}-{hold.peer}",
                    logging.ERROR,
                    "GPU%d: its MPS control daemon waits on process(es) %s, connected to its "
                    "control socket, sending or reading nothing: MPS answers no tenant of the "
                    "card; handed to enforcement",
                    card.index,
                    ", ".join(str(pid) for pid, _ in hold.holders),
                )
        seen = "held" if held else "waited on"
        return Health(
            HealthState.HUNG,
            f"{hung.reason}; the control daemon waits on a client that connected to its "
            f"control socket and sends or reads nothing ({seen}: process {pids})",
            hung.servers,
            hung.clients,
        )

    def _shareable_mib(self, card: Card) -> int:
        return (card.memory_mib // self._unit_mib) * self._unit_mib

    def _check_defaults(self, card: Card, state: _CardState) -> None:
        """Any tenant can set a pinned limit of 1M or a 3 % share for every later server on
        the card through the unprivileged socket: restore them and say so."""
        now = time.monotonic()
        period = max(DEFAULTS_CHECK_SECONDS, self._settings.health_check_interval_seconds)
        if now - state.defaults_checked_at < period:
            return
        state.defaults_checked_at = now
        client = state.daemon.client
        shareable_mib = self._shareable_mib(card)
        try:
            pinned_mib = client.default_pinned_mem_limit_mib("0")
            percent = client.default_active_thread_percentage()
            if pinned_mib != shown_pinned_limit_mib(shareable_mib):
                client.set_default_pinned_mem_limit("0", shareable_mib)
            if percent != DEFAULT_THREAD_PERCENT:
                client.set_default_active_thread_percentage(DEFAULT_THREAD_PERCENT)
        except MpsError as e:
            log.warning("GPU%d: cannot read back the MPS defaults: %s", card.index, e)
            return
        if pinned_mib != shown_pinned_limit_mib(shareable_mib) or percent != DEFAULT_THREAD_PERCENT:
            log.warning(
                "GPU%d: the MPS defaults were changed through the client socket (pinned "
                "memory limit %s, active thread percentage %g %%; any client, a tenant too, "
                "can do that): restored to %d MiB and %g %%",
                card.index,
                "none" if pinned_mib is None else f"{pinned_mib} MiB",
                percent,
                shareable_mib,
                DEFAULT_THREAD_PERCENT,
            )

    def _watch(self, state: _CardState, identity: DaemonIdentity) -> None:
        if state.watched is not None and state.watched[0] == identity:
            return
        self._unwatch(state)
        try:
            pidfd = os.pidfd_open(identity.pid)
        except OSError:
            return  # gone already (the next check sees it) or no pidfds: checks alone
        stat = proc.stat_of(identity.pid)
        if stat is None or stat.start_ticks != identity.start_ticks:
            os.close(pidfd)  # the PID was reused between the check and the open
            return
        state.watched = (identity, pidfd)

    def _unwatch(self, state: _CardState) -> None:
        if state.watched is not None:
            with contextlib.suppress(OSError):
                os.close(state.watched[1])
            state.watched = None

    def _unverified(self, card: Card, state: _CardState) -> None:
        """Its servers would be killed as unallocated, so no shared work."""
        user = "root" if os.geteuid() == 0 else f"uid {os.geteuid()}"
        reason = (
            f"an MPS control daemon answers at {state.daemon.pipe_dir} but no single process "
            f"of {state.daemon.binary} running as {user} outside every container holds its "
            "listening control socket, so its MPS servers cannot be told from tenants' "
            "processes; stop whatever else serves that directory (or a control binary "
            "configured as a wrapper: set mps.control_binary to NVIDIA's binary) and let "
            "gpushare-node start the daemon again"
        )
        self._problem(
            card, state, Health(HealthState.BROKEN, reason), "MPS control daemon not verified"
        )

    def _schedule_retry(self, state: _CardState) -> float:
        state.failures += 1
        delay = min(2.0 ** (state.failures - 1), BACKOFF_MAX_SECONDS)
        state.retry_at = time.monotonic() + delay
        return delay

    def _start(self, card: Card, state: _CardState, down: Health) -> Health:
        if state.mode is not None:
            log.warning("GPU%d: restarting its MPS control daemon", card.index)
        try:
            state.daemon.start()
        except MpsError as e:
            delay = self._schedule_retry(state)
            log.error(
                "GPU%d: cannot start the MPS control daemon: %s (next try in %g s)",
                card.index,
                e,
                delay,
            )
            return Health(HealthState.DOWN, str(e))
        log.info(
            "GPU%d: started MPS control daemon (pid %s, pipe %s)",
            card.index,
            state.daemon.pid(),
            state.daemon.pipe_dir,
        )
        return state.daemon.probe()

    def _leave_mps(self, card: Card, state: _CardState) -> None:
        if state.mode == "whole":
            return
        health = state.daemon.probe()
        if health.state is not HealthState.DOWN:
            if health.clients:
                self._note(
                    state,
                    f"wait-{health.clients}",
                    logging.WARNING,
                    "GPU%d is given out whole but %d MPS clients still run: MPS stays "
                    "until they exit",
                    card.index,
                    health.clients,
                )
                return
            try:
                state.daemon.stop()
            except MpsError as e:
                self._note(
                    state,
                    "stop-failed",
                    logging.ERROR,
                    "GPU%d: cannot stop its MPS control daemon: %s",
                    card.index,
                    e,
                )
                return
        try:
            self._inventory.set_compute_mode(card.uuid, "DEFAULT")
        except InventoryError as e:
            self._note(state, "mode-failed", logging.ERROR, "GPU%d: %s", card.index, e)
            return
        log.info(
            "GPU%d given out whole: left MPS (control daemon stopped, compute mode DEFAULT)",
            card.index,
        )
        state.mode, state.identity, state.notes = "whole", None, set()

    def _problem(
        self, card: Card, state: _CardState, health: Health, summary: str | None = None
    ) -> None:
        summary = (
            summary
            or {
                HealthState.DOWN: "MPS control daemon down",
                HealthState.HUNG: "MPS control daemon not answering",
                HealthState.BROKEN: "MPS control daemon answers unexpectedly",
                HealthState.FAULT: "MPS server in FAULT",
            }[health.state]
        )
        state.health = health  # what nodemgr status shows: the problem, not the probe
        if state.problem != summary:
            log.error(
                "GPU%d: %s, its shared devices are Unhealthy: %s",
                card.index,
                summary,
                health.reason,
            )
        self._set_problem(card, state, summary)

    def _set_problem(self, card: Card, state: _CardState, problem: str | None) -> None:
        if state.problem is not None and problem is None:
            log.info("GPU%d: MPS healthy again, its shared devices are Healthy", card.index)
        state.problem = problem
        self._allocator.set_card_problem(card.uuid, problem)

    def _note(self, state: _CardState, key: str, level: int, message: str, *args) -> None:
        if key not in state.notes:
            state.notes.add(key)
            log.log(level, message, *args)

    # -- /dev/shm ------------------------------------------------------------------

    def _prepare_shm(self) -> None:
        layout = self._layout
        if not self._isolate:
            log.warning(
                "not running as root: the cards' /dev/shm directories under %s are plain "
                "directories (no tmpfs, no size) and the MPS control daemons keep "
                "gpushare-node's /dev/shm; run gpushare-node as root",
                layout.root,
            )
            for uuid in self._states:
                os.makedirs(layout.shm_dir(uuid), exist_ok=True)
                os.chmod(layout.shm_dir(uuid), 0o1777)
            return
        self._retire_node_wide_shm()
        try:
            prepare_directory(layout.namespace_dir)
        except (MountError, OSError) as e:
            # Every start of a control daemon then fails and says why (card Unhealthy).
            log.error("cannot make %s a private mount: %s", layout.namespace_dir, e)
        for uuid, state in self._states.items():
            self._mount_shm(self._cards[uuid], state)

    def _retire_node_wide_shm(self) -> None:
        """``MpsLayout.retired_shm_dir``, unmounted lazily (containers started with it keep
        it); the hook refuses a container that still names it."""
        path = self._layout.retired_shm_dir
        try:
            if shm.unmount(path):
                log.warning(
                    "unmounted the /dev/shm tmpfs that earlier versions shared between "
                    "every card's containers (%s): containers started with it keep it until "
                    "they exit; one of theirs started again is refused (recreate its pod); "
                    "new containers get no /dev/shm from gpushare-node (their runtime's own)",
                    path,
                )
        except MountError as e:
            log.error("cannot unmount the node-wide /dev/shm of earlier versions: %s", e)
        with contextlib.suppress(OSError):
            os.rmdir(path)

    def _mount_shm(self, card: Card, state: _CardState) -> bool:
        path = self._layout.shm_dir(card.uuid)
        try:
            how = shm.mount(path, self._shm_mib)
        except (MountError, OSError) as e:
            if state.shm_problem is None:
                log.error("GPU%d: cannot mount its /dev/shm tmpfs at %s: %s", card.index, path, e)
            state.shm_problem = str(e)
            return False
        state.shm_problem = None
        if how != "kept":
            log.info("GPU%d: /dev/shm %s: %d MiB tmpfs at %s", card.index, how, self._shm_mib, path)
        return True

    def _empty_shm(self, card: Card, state: _CardState, whole: bool) -> None:
        identity, stopped = state.identity, False
        if identity is not None and state.daemon.servers(identity):
            health = state.daemon.probe()
            if whole or not health.ok or health.clients:
                return  # leaving MPS (whole), in trouble, or in use: not now
            log.info(
                "GPU%d holds no shared allocation: stopping its idle MPS server with the "
                "control daemon to empty its /dev/shm",
                card.index,
            )
            try:
                state.daemon.stop()
            except MpsError as e:
                self._problem(card, state, Health(HealthState.BROKEN, str(e)))
                return
            self._unwatch(state)
            state.identity, state.mode, state.failures, state.retry_at = None, None, 0, 0.0
            stopped = True
        path = self._layout.shm_dir(card.uuid)
        try:
            emptied = self._allocator.while_idle(card.uuid, lambda: shm.empty(path))
        except OSError as e:
            self._note(
                state,
                "empty-failed",
                logging.ERROR,
                "GPU%d: cannot empty %s: %s",
                card.index,
                path,
                e,
            )
            emptied = None
        if stopped:
            self._keep_mps(card, state)
        if emptied is None:
            return
        if emptied.left:
            self._note(
                state,
                "shm-left",
                logging.ERROR,
                "GPU%d: emptying its /dev/shm %s left %d entries that cannot be removed",
                card.index,
                path,
                emptied.left,
            )
            return
        state.notes.discard("shm-left")
        if emptied.removed:
            log.info(
                "GPU%d holds no shared allocation: emptied its /dev/shm (%d entries removed)",
                card.index,
                emptied.removed,
            )


def _has_entries(path: str) -> bool:
    """Unreadable: no."""
    try:
        with os.scandir(path) as entries:
            return next(entries, None) is not None
    except OSError:
        return False
