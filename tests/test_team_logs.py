"""Teams' output kept apart, in a real JetStream behind the rendered accounts: a node agent (the
`executor` role) makes each team's logs stream as it first stores that team's lines, over a logs
stream an older deployment left; team alpha's ten jobs flood past their wait on the node and past
alpha's bytes, and team beta's older lines are all still read back by the API (the `api` role), with
no word of alpha's drops, which are said in alpha's jobs' own logs only."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from nats.js import api

from launcher.nats import nats_from_binary
from services.api.logs import job_page
from services.node.output import Output, Storing
from shared import permissions, storage, subjects
from shared.bus import Bus
from shared.schema.logs import LogsRequest

pytestmark = pytest.mark.e2e  # it starts a nats-server

ROLES = ("operator", "executor", "api")
PASSWORDS = {name: f"{name}-Secret-9x" for name in (*ROLES, "user", "ann", "bea")}
TEAMS = {"ann": "alpha", "bea": "beta"}
# Small budgets, so the flood is quick: the mechanism is the plan's (a stream per team, a job one of
# its subjects); test_logs checks the plan's numbers.
TEAM_BYTES, JOB_BATCHES, PENDING = 256 * 1024, 2, 100


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    config = permissions.render_server_config(
        {role: PASSWORDS[role] for role in ROLES},
        {login: PASSWORDS[login] for login in ("user", "ann", "bea")},
        teams=TEAMS,
    )
    with nats_from_binary(tmp_path_factory.mktemp("team-logs"), config=config) as url:
        yield url


async def _connect(url: str, role: str) -> Bus:
    return await Bus.connect(
        url,
        f"test-{role}",
        user=role,
        password=PASSWORDS[role],
        inbox_prefix=permissions.inbox_prefix(role),
        allow_reconnect=False,
        max_reconnect_attempts=1,
    )


async def _small(bus: Bus, team: str) -> None:
    await storage.ensure_logs(bus, team, max_bytes=TEAM_BYTES, max_msgs_per_subject=JOB_BATCHES)


async def _scenario(url: str):
    operator, agent, reader = [await _connect(url, role) for role in ROLES]
    try:
        # An older deployment's logs stream, every team's in it: provisioning brings it to the plan
        # (DEFAULT_TEAM's), so the teams' own streams can be made beside it.
        await operator.ensure_stream(
            subjects.LOGS_STREAM, subjects.LOGS_SUBJECTS, max_bytes=256 * storage.MIB, discard=api.DiscardPolicy.OLD
        )
        await agent.js.publish("goodput.logs.old-1.0", b"an older agent's batch")
        await storage.provision(operator)
        await storage.open_stream(operator, subjects.LOGS_STREAM)

        output = Output(max_pending=PENDING)
        storing = Storing(agent, output, _small)
        beta = output.keeper("beta.b-1", 0, "stdout", team="beta")
        for n in range(3):  # beta's job printed first: its lines are the older
            beta(f"beta {n}")
        await storing.store()
        for job in range(10):
            keep = output.keeper(f"alpha.a-{job}", 0, "stdout", team="alpha")
            for n in range(PENDING + 50):
                keep(f"a-{job} {n} " + "x" * 1000)
        beta("beta 3")  # while alpha's jobs overflow their wait on this node
        await storing.store()

        pages = {
            job: await job_page(reader, team, scoped, LogsRequest(job))
            for team, scoped, job in (("beta", "beta.b-1", "b-1"), ("alpha", "alpha.a-9", "a-9"))
        }
        streams = {
            team: await agent.js.stream_info(subjects.logs_stream(team), subjects_filter=">") for team in TEAMS.values()
        }
        return pages, streams
    finally:
        for bus in (operator, agent, reader):
            await bus.close()


def test_one_teams_flood_ages_out_only_its_own_output_and_says_so_in_its_own_jobs_logs(server: str) -> None:
    pages, streams = asyncio.run(_scenario(server))
    beta_lines, _, more = pages["b-1"]
    assert [line.text for line in beta_lines] == ["beta 0", "beta 1", "beta 2", "beta 3"] and not more
    assert streams["beta"].state.messages == 2  # none of beta's aged out, none of alpha's there
    alpha = streams["alpha"]
    assert alpha.config.subjects == [subjects.team_logs("alpha")]
    # Alpha stored some 1.5 MB: past its bytes, its oldest went; each job kept its share at most.
    assert alpha.state.bytes <= TEAM_BYTES and alpha.state.first_seq > 1, alpha.state
    assert max(alpha.state.subjects.values()) == JOB_BATCHES, alpha.state.subjects  # each job stored 4
    # The newest job's log ends with its own drops, said there alone.
    a9, _, _ = pages["a-9"]
    assert a9[-1].text == "[goodput: 50 lines of this job dropped here: it printed faster than they could be stored]"
    assert [line.text for line in a9[:-1]] == [f"a-9 {n} " + "x" * 1000 for n in range(PENDING - len(a9) + 1, PENDING)]
    assert not [line for line in beta_lines if "dropped" in line.text]
