"""Grammars wait their turn and cost their own request only, on a real daemon with real
grammar children (a fake worker that enforces grammars, ``grammar.timeout_s`` = 2 s):
a request without a grammar on the same connection is served while a slow grammar is
checked; a valid schema from another client is answered before hostile ones that were
sent first are refused; a client that leaves stops its check; a schema sent again, or by
``n`` choices, is checked once."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import pytest

pytest.importorskip("llguidance")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from sclsd import protocol as P  # noqa: E402
from sclsd.client import AsyncClient, RequestError, status  # noqa: E402
from sclsd.launch import DaemonProcess  # noqa: E402

from .opshelp import wait_for  # noqa: E402
from .test_hostile_grammars import SCHEMA, start  # noqa: E402


def slow(salt: int = 0) -> P.Structured:
    """90,000 choices: about 6 s of llguidance's lexer on a 2-core machine, past timeout_s = 2 s
    (refused); ``salt`` makes distinct grammars (each checked, none from the cache)."""
    return P.Structured(kind="choice", value=json.dumps([str(i) for i in range(90_000)] + [f"s{salt}"]))


def valid(salt: str = "") -> P.Structured:
    return P.Structured(kind="json_schema", value=json.dumps({**SCHEMA, "description": salt}))


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    d = start(tmp_path_factory.mktemp("grammar-turns"), timeout_s=2.0)
    yield d
    assert d.stop(timeout=30) == 0, d.log.read_text()[-3000:]


def checks(d: DaemonProcess) -> dict[str, float]:
    """``sclsd:grammar_checks_total`` by outcome, and the refusals as ``refused:<cause>``."""
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(status(d.status_sock, metrics=True)):
        for s in fam.samples:
            if s.name == "sclsd:grammar_checks_total":
                out[s.labels["outcome"]] = s.value
            elif s.name == "sclsd:grammar_refusals_total":
                out[f"refused:{s.labels['cause']}"] = s.value
    return out


def test_a_request_without_a_grammar_is_served_while_its_connections_grammar_is_checked(
        daemon: DaemonProcess) -> None:
    async def go() -> list[str]:
        order: list[str] = []
        async with AsyncClient(daemon.sock) as c:
            async def hostile() -> None:
                with pytest.raises(RequestError):
                    await c.complete(id="slow", prompt="x", max_tokens=4, structured=slow())
                order.append("slow refused")

            async def plain() -> None:
                done = await c.complete(id="plain", prompt="x", max_tokens=8, ignore_eos=True, temperature=0.0)
                assert done.finish_reason == "length"
                order.append("plain done")

            first = asyncio.ensure_future(hostile())
            await asyncio.sleep(0)  # its frame goes first
            await asyncio.gather(first, plain())
        return order

    # Frames read one at a time would have held the plain request until the grammar's refusal.
    assert asyncio.run(go()) == ["plain done", "slow refused"]


def test_a_valid_schema_is_answered_before_hostile_ones_sent_first_are_refused(daemon: DaemonProcess) -> None:
    async def go() -> list[str]:
        order: list[str] = []

        async def hostile(i: int) -> None:
            async with AsyncClient(daemon.sock) as c:
                with pytest.raises(RequestError):
                    await c.complete(prompt="x", max_tokens=4, structured=slow(100 + i))
                order.append("hostile refused")

        tasks = [asyncio.ensure_future(hostile(i)) for i in range(4)]
        await asyncio.sleep(0.2)
        async with AsyncClient(daemon.sock) as c:
            done = await c.complete(prompt="json please", max_tokens=40, temperature=0.0,
                                    structured=valid("bystander"))
            assert json.loads((done.text or "").rstrip("\x02"))["ok"] in (True, False)
            order.append("valid done")
        await asyncio.gather(*tasks)
        return order

    # First come, first served over 2 children, it would have waited for 2 refusals (4 s):
    # first tries past quick_s make way for it.
    assert asyncio.run(go()) == ["valid done"] + ["hostile refused"] * 4


def test_a_client_that_leaves_stops_its_grammars_check(daemon: DaemonProcess) -> None:
    before = checks(daemon)

    async def go() -> None:
        c = await AsyncClient(daemon.sock).connect()
        asyncio.ensure_future(c.complete(prompt="x", max_tokens=4, structured=slow(7)))
        await asyncio.to_thread(wait_for, lambda: checks(daemon)["checked"] > before["checked"],
                                30.0, "the check to start")
        await c.close()

    asyncio.run(go())
    wait_for(lambda: checks(daemon)["stopped"] > before["stopped"], 30.0, "the check to stop")
    after = checks(daemon)
    assert after["refused:timeout"] == before["refused:timeout"]  # never ran to its limit


def test_a_schema_sent_again_or_by_n_choices_is_checked_once(daemon: DaemonProcess) -> None:
    before = checks(daemon)

    async def go() -> None:
        async with AsyncClient(daemon.sock) as c:
            dones = await c.complete(n=3, prompt="json please", max_tokens=40, temperature=0.0,
                                     structured=valid("once"))
            assert len(dones) == 3
            again = await c.complete(prompt="json please", max_tokens=40, temperature=0.0,
                                     structured=valid("once"))
            assert again.text == dones[0].text

    asyncio.run(go())
    after = checks(daemon)
    assert after["checked"] - before["checked"] == 1
    assert (after["cached"] + after["shared"]) - (before["cached"] + before["shared"]) == 3

