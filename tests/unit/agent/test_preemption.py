"""Preemption detectors (agent/preemption.py) against the loopback mock (spotlight/cloud/mock_metadata.py).

Spec: docs/preemption-notices.md §0-§5. No fixed sleeps; every server binds port 0.
"""

from __future__ import annotations

import email.utils
import json
import subprocess
import sys
import threading
import time

import pytest
import requests

from agent.preemption import (
    AwsImdsDetector,
    AzureScheduledEventsDetector,
    GcpMetadataDetector,
    NoticeLedger,
    NullDetector,
    PreemptionNotice,
    make_detector,
    revoke_notice,
    sigterm_notice,
)
from spotlight.cloud.mock_metadata import MockMetadataServer, control
from tests.fakes import FakeClock

FAST = 0.5  # client timeout for fault tests (s); the mock's "hang" lasts until stop()
ROOMY = 10.0  # client timeout where no request should time out: a loaded machine cannot fake one


def timeout_for(kind: str) -> float:
    """FAST for a fault the client must time out on; else ROOMY (a request that merely ran
    slow on a loaded machine once read as a timeout there, not as the injected error)."""
    return FAST if "hang" in kind else ROOMY


@pytest.fixture
def aws():
    with MockMetadataServer("aws") as m:
        yield m


@pytest.fixture
def gcp():
    with MockMetadataServer("gcp") as m:
        yield m


@pytest.fixture
def azure():
    with MockMetadataServer("azure") as m:
        yield m


def poll_ok(det, now=None):
    r = det.poll(time.time() if now is None else now)
    assert r.healthy and r.error is None, r.error
    return r.notices


# --- module basics ---------------------------------------------------------------------------
@pytest.mark.procs
def test_import_does_not_pull_torch():
    code = "import agent.preemption, spotlight.cloud.mock_metadata, sys; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_ledger_persists_atomically(tmp_path):
    path = tmp_path / "sub" / "ledger.json"
    led = NoticeLedger(path)
    assert not led.seen("a")
    led.mark("a")
    led.mark("b")
    assert led.seen("a") and NoticeLedger(path).seen("b")
    assert sorted(p.name for p in path.parent.iterdir()) == ["ledger.json"]  # no tmp left over
    path.write_text("{not json")
    assert not NoticeLedger(path).seen("a")  # corrupt ledger: start empty, don't crash
    mem = NoticeLedger(None)
    mem.mark("x")
    assert mem.seen("x")


def test_notice_roundtrip_and_local_sources():
    n = sigterm_notice(30.0, 1000.0)
    assert (n.source, n.scope, n.kind, n.deadline_unix_s) == ("sigterm", "node", "terminate", 1030.0)
    r = revoke_notice([1, 0, 1], 5.0, 1000.0, key="k1")
    assert (r.scope, r.key, r.kind, r.deadline_unix_s) == ("gpu:0,1", "k1", "revoke", 1005.0)
    assert PreemptionNotice.from_dict(json.loads(json.dumps(r.to_dict()))) == r
    with pytest.raises(ValueError):
        revoke_notice([], 5.0, 0.0)
    with pytest.raises(ValueError):
        sigterm_notice(-1.0, 0.0)


def test_make_detector():
    led = NoticeLedger(None)
    assert isinstance(make_detector("aws", None, ledger=led), AwsImdsDetector)
    assert isinstance(make_detector("gcp", "http://x:1", ledger=led), GcpMetadataDetector)
    assert isinstance(make_detector("azure", None, ledger=led), AzureScheduledEventsDetector)
    null = make_detector("none", None, ledger=led)
    assert isinstance(null, NullDetector) and poll_ok(null) == []
    with pytest.raises(ValueError, match="unknown cloud 'oracle'"):
        make_detector("oracle", None, ledger=led)
    with pytest.raises(ValueError):
        AwsImdsDetector(ledger=led, token_ttl_s=0)


# --- mock header checks ----------------------------------------------------------------------
def test_mock_enforces_real_headers(aws, gcp, azure):
    s = requests.Session()
    s.trust_env = False
    assert s.get(aws.url + "/latest/meta-data/spot/instance-action").status_code == 401
    assert s.put(aws.url + "/latest/api/token").status_code == 400
    assert (
        s.put(aws.url + "/latest/api/token", headers={"X-aws-ec2-metadata-token-ttl-seconds": "21601"}).status_code
        == 400
    )
    assert (
        s.put(aws.url + "/2021-03-23/api/token", headers={"X-aws-ec2-metadata-token-ttl-seconds": "60"}).status_code
        == 403
    )
    assert (
        s.get(
            aws.url + "/latest/meta-data/spot/instance-action", headers={"X-aws-ec2-metadata-token": "bogus"}
        ).status_code
        == 401
    )
    r = s.get(gcp.url + "/computeMetadata/v1/instance/preempted")
    assert r.status_code == 403 and r.headers["Metadata-Flavor"] == "Google"
    r = s.get(gcp.url + "/computeMetadata/v1/instance/preempted", headers={"Metadata-Flavor": "Google"})
    assert (r.status_code, r.text, bool(r.headers.get("ETag"))) == (200, "FALSE", True)
    assert s.get(azure.url + "/metadata/scheduledevents?api-version=2020-07-01").status_code == 400


def test_control_api_over_http(azure):
    st = control(azure.url, "notice", lead_time_s=60, event_id="E1")
    assert [e["EventId"] for e in st["azure_events"]] == ["E1"] and st["azure_incarnation"] == 2
    assert control(azure.url, "fault", kind="503", count=2)["pending_faults"] == [["503", 2]]
    assert control(azure.url, "cancel")["azure_events"] == []
    with pytest.raises(requests.HTTPError):
        control(azure.url, "fault", kind="nope")
    assert control(azure.url, "state")["cloud"] == "azure"


def test_cli_registers_command():
    import typer
    from typer.testing import CliRunner

    from spotlight.cli.mock_metadata import register

    app = typer.Typer()

    @app.callback()
    def main() -> None:
        pass

    register(app)
    res = CliRunner().invoke(app, ["mock-metadata", "--help"])
    assert res.exit_code == 0, res.output
    for opt in ("--cloud", "--host", "--port", "--notice-after-s", "--lead-time-s"):
        assert opt in res.output
    assert CliRunner().invoke(app, ["mock-metadata", "--cloud", "oracle"]).exit_code != 0


# --- AWS -------------------------------------------------------------------------------------
def test_aws_notice_deadline_dedup_and_restart(aws, tmp_path):
    path = tmp_path / "ledger.json"
    det = AwsImdsDetector(aws.url, ledger=NoticeLedger(path))
    assert poll_ok(det) == []
    t0 = time.time()
    aws.issue_notice(lead_time_s=60)
    [n] = poll_ok(det)
    t1 = time.time()
    assert (n.source, n.scope, n.kind, n.is_hint) == ("aws", "node", "terminate", False)
    assert t0 + 59 <= n.deadline_unix_s <= t1 + 60  # `time` is whole seconds
    assert len(n.key) == 64
    assert poll_ok(det) == []
    restarted = AwsImdsDetector(aws.url, ledger=NoticeLedger(path))
    assert poll_ok(restarted) == []


def test_aws_deadline_capped_at_120s_and_hibernate_is_now(aws):
    det = AwsImdsDetector(aws.url, ledger=NoticeLedger(None))
    aws.issue_notice(lead_time_s=3600)  # skewed/approximate `time`: cap at received + 120 s
    now = time.time()
    [n] = poll_ok(det, now)
    assert now + 119 <= n.deadline_unix_s <= time.time() + 120
    aws.cancel_notice()
    assert poll_ok(det) == []
    aws.issue_notice(action="hibernate")
    now = time.time()
    [h] = poll_ok(det, now)
    assert h.kind == "hibernate" and now <= h.deadline_unix_s <= time.time()


def test_aws_unpinned_time_is_deduped_by_notice(aws):
    aws.clock = FakeClock(1.7e9, step=7.0)  # each request sees a later "now" (no sleeping)
    aws.issue_notice(lead_time_s=120, pinned=False)  # `time` recomputed per request (AEMM quirk 1)
    det = AwsImdsDetector(aws.url, ledger=NoticeLedger(None), check_rebalance=False)
    s = requests.Session()
    s.trust_env = False
    tok = s.put(aws.url + "/latest/api/token", headers={"X-aws-ec2-metadata-token-ttl-seconds": "60"}).text
    bodies = {
        s.get(aws.url + "/latest/meta-data/spot/instance-action", headers={"X-aws-ec2-metadata-token": tok}).text
        for _ in range(2)
    }
    assert len(bodies) == 2  # the premise: bodies differ between requests
    assert len(poll_ok(det)) == 1
    for _ in range(3):  # still one notice
        assert poll_ok(det) == []
    aws.cancel_notice()
    assert poll_ok(det) == []
    aws.issue_notice(pinned=False)  # a new notice after the endpoint went back to 404
    assert len(poll_ok(det)) == 1


def test_aws_rebalance_is_a_hint(aws):
    det = AwsImdsDetector(aws.url, ledger=NoticeLedger(None))
    aws.issue_rebalance()
    [h] = poll_ok(det)
    assert h.is_hint and h.kind == "rebalance"
    aws.issue_notice()
    [n] = poll_ok(det)
    assert not n.is_hint and n.kind == "terminate"


def test_aws_token_reused_and_refreshed_on_401(aws):
    det = AwsImdsDetector(aws.url, ledger=NoticeLedger(None))
    for _ in range(3):
        poll_ok(det)
    assert aws.tokens_issued == 1 and det.tokens_fetched == 1
    aws.inject_fault("401")  # all tokens expire
    aws.issue_notice()
    assert len(poll_ok(det)) == 1
    assert aws.tokens_issued == 2


@pytest.mark.parametrize(
    "kind,needle",
    [
        ("401-always", "HTTP 401"),
        ("403", "HTTP 403"),
        ("429", "HTTP 429"),
        ("503", "HTTP 503"),
        ("hang", "timeout"),
        ("malformed", "malformed"),
        ("drop", "connection"),
    ],
)
def test_aws_errors_are_unhealthy(aws, kind, needle):
    det = AwsImdsDetector(aws.url, ledger=NoticeLedger(None), timeout_s=timeout_for(kind))
    poll_ok(det)  # token in hand
    aws.inject_fault(kind, count=2)
    r = det.poll(time.time())
    assert not r.healthy and r.notices == []
    assert r.error.startswith("aws: ") and needle in r.error, r.error


def test_aws_token_put_hang_and_refused_connection(aws):
    aws.inject_fault("token-hang")
    r = AwsImdsDetector(aws.url, ledger=NoticeLedger(None), timeout_s=FAST).poll(time.time())
    assert not r.healthy and "timeout" in r.error and "api/token" in r.error
    url = aws.url
    aws.stop()
    r = AwsImdsDetector(url, ledger=NoticeLedger(None), timeout_s=FAST).poll(time.time())
    assert not r.healthy and r.error.startswith("aws: connection failed")


# --- GCP -------------------------------------------------------------------------------------
def test_gcp_notice_dedup_restart_and_env_host(gcp, tmp_path, monkeypatch):
    monkeypatch.setenv("GCE_METADATA_HOST", gcp.url.removeprefix("http://"))
    path = tmp_path / "ledger.json"
    det = GcpMetadataDetector(ledger=NoticeLedger(path))
    assert poll_ok(det) == []
    gcp.issue_notice()
    now = time.time()
    [n] = poll_ok(det, now)
    assert (n.source, n.kind, n.scope) == ("gcp", "preempt", "node")
    assert n.key == f"gcp-preempted-{gcp.state()['gcp_etag']}"
    assert now + 30 <= n.deadline_unix_s <= time.time() + 30
    assert poll_ok(det) == []
    assert poll_ok(GcpMetadataDetector(gcp.url, ledger=NoticeLedger(path))) == []


def test_gcp_long_poll_returns_on_flip(gcp):
    det = GcpMetadataDetector(gcp.url, ledger=NoticeLedger(None), long_poll_s=30)
    assert poll_ok(det) == []  # plain GET: learns the ETag

    def flip():
        assert gcp.long_poll_waiting.wait(20)
        gcp.issue_notice()

    th = threading.Thread(target=flip)
    th.start()
    [n] = poll_ok(det)  # hanging GET, released by the flip
    th.join()
    assert n.kind == "preempt" and gcp.long_poll_waiting.is_set()


def test_gcp_long_poll_last_etag_and_timeout(gcp):
    det = GcpMetadataDetector(gcp.url, ledger=NoticeLedger(None), long_poll_s=0.2)
    assert poll_ok(det) == []
    assert poll_ok(det) == []  # timeout_sec elapses with no change: healthy, nothing
    gcp.issue_notice()  # changed between polls: last_etag differs, returns at once
    assert len(poll_ok(det)) == 1


@pytest.mark.parametrize(
    "kind,needle", [("403", "HTTP 403"), ("503", "HTTP 503"), ("hang", "timeout"), ("malformed", "malformed")]
)
def test_gcp_errors_are_unhealthy(gcp, kind, needle):
    det = GcpMetadataDetector(gcp.url, ledger=NoticeLedger(None), timeout_s=timeout_for(kind))
    gcp.inject_fault(kind)
    r = det.poll(time.time())
    assert not r.healthy and r.error.startswith("gcp: ") and needle in r.error, r.error
    assert poll_ok(det) == []  # recovers


def test_gcp_requires_flavor_response_header(azure):
    r = GcpMetadataDetector(azure.url, ledger=NoticeLedger(None)).poll(time.time())
    assert not r.healthy and "gcp: HTTP 404" in r.error


# --- Azure -----------------------------------------------------------------------------------
def test_azure_preempt_deadline_dedup_restart(azure, tmp_path):
    path = tmp_path / "ledger.json"
    det = AzureScheduledEventsDetector(azure.url, ledger=NoticeLedger(path), vm_name="spot-vm-0")
    assert poll_ok(det) == []
    azure.issue_notice(lead_time_s=300, event_id="E-far")  # NotBefore far: +30 s wins
    now = time.time()
    [n] = poll_ok(det, now)
    assert (n.source, n.kind, n.key) == ("azure", "preempt", "E-far")
    assert now + 30 <= n.deadline_unix_s <= time.time() + 30
    azure.issue_notice(lead_time_s=10, event_id="E-near")  # NotBefore sooner: it wins
    t0 = time.time()
    [m] = poll_ok(det)
    assert m.key == "E-near" and t0 + 9 <= m.deadline_unix_s <= time.time() + 10
    assert poll_ok(det) == []
    assert poll_ok(AzureScheduledEventsDetector(azure.url, ledger=NoticeLedger(path))) == []


def test_azure_cancel_ack_started_and_terminate(azure):
    det = AzureScheduledEventsDetector(azure.url, ledger=NoticeLedger(None))
    azure.issue_notice(event_id="E1")
    inc = azure.state()["azure_incarnation"]
    azure.cancel_notice()
    assert azure.state()["azure_incarnation"] == inc + 1
    assert poll_ok(det) == []
    azure.issue_notice(event_id="E2")
    [n] = poll_ok(det)
    azure.inject_fault("503")
    det.acknowledge(n)  # a failed approval is logged, not raised
    assert azure.acknowledged == []
    det.acknowledge(n)
    det.acknowledge(sigterm_notice(1.0, 0.0))  # not an Azure notice: no POST
    assert azure.acknowledged == ["E2"]
    assert azure.state()["azure_events"][0]["EventStatus"] == "Started"
    now = time.time()
    [s] = poll_ok(AzureScheduledEventsDetector(azure.url, ledger=NoticeLedger(None)), now)
    assert now <= s.deadline_unix_s <= time.time()  # Started: deadline is now
    azure.issue_notice(lead_time_s=600, action="Terminate", event_id="T1")
    azure.issue_notice(lead_time_s=600, action="Freeze", event_id="F1")
    [t] = poll_ok(det)
    nb = email.utils.parsedate_to_datetime(azure.state()["azure_events"][1]["NotBefore"]).timestamp()
    assert (t.kind, t.key, t.deadline_unix_s) == ("terminate", "T1", nb)


def test_azure_resources_filter(azure):
    azure.issue_notice(event_id="OTHER", resources=["spot-vm-7"])
    assert poll_ok(AzureScheduledEventsDetector(azure.url, ledger=NoticeLedger(None), vm_name="spot-vm-0")) == []
    assert len(poll_ok(AzureScheduledEventsDetector(azure.url, ledger=NoticeLedger(None), vm_name="SPOT-VM-7"))) == 1
    # no vm_name: the detector learns "spot-vm-0" from IMDS compute/name and skips the event
    assert poll_ok(AzureScheduledEventsDetector(azure.url, ledger=NoticeLedger(None))) == []


@pytest.mark.parametrize(
    "kind,needle",
    [("400", "HTTP 400"), ("429", "HTTP 429"), ("503", "HTTP 503"), ("hang", "timeout"), ("malformed", "malformed")],
)
def test_azure_errors_are_unhealthy(azure, kind, needle):
    azure.issue_notice(event_id="E1")
    det = AzureScheduledEventsDetector(azure.url, ledger=NoticeLedger(None), timeout_s=timeout_for(kind))
    azure.inject_fault(kind)
    r = det.poll(time.time())
    assert not r.healthy and r.notices == []
    assert r.error.startswith("azure: ") and needle in r.error, r.error
    assert len(poll_ok(det)) == 1  # the notice was not lost to the error


# --- GCP maintenance-event (docs/preemption-notices.md §2.3) ----------------------------------------------
def test_gcp_terminate_on_host_maintenance_is_a_node_notice(gcp, tmp_path):
    path = tmp_path / "ledger.json"
    det = GcpMetadataDetector(gcp.url, ledger=NoticeLedger(path))
    assert poll_ok(det) == []
    gcp.set_maintenance("MIGRATE_ON_HOST_MAINTENANCE")  # live migration: the VM survives
    assert poll_ok(det) == []
    control(gcp.control_url, "maintenance", value="TERMINATE_ON_HOST_MAINTENANCE")
    now = time.time()
    [n] = poll_ok(det, now)
    assert (n.source, n.kind, n.scope, n.is_hint) == ("gcp", "terminate", "node", False)
    assert n.key.startswith("gcp-maintenance-") and "TERMINATE_ON_HOST_MAINTENANCE" in n.detail
    assert now + 60 <= n.deadline_unix_s <= time.time() + 60  # GCP_MAINTENANCE_NOTICE_S
    assert poll_ok(det) == []  # deduplicated
    r = GcpMetadataDetector(gcp.url, ledger=NoticeLedger(path)).poll(time.time())  # restart
    assert r.healthy and r.notices == [] and [k.key for k in r.known] == [n.key]
    gcp.set_maintenance("NONE")
    assert poll_ok(det) == []


def test_gcp_maintenance_event_bad_value_is_unhealthy_and_404_is_none(gcp):
    from agent import preemption

    gcp._maintenance = "SOMETHING_ELSE"  # a value Google does not document
    r = GcpMetadataDetector(gcp.url, ledger=NoticeLedger(None)).poll(time.time())
    assert not r.healthy and "malformed body on instance/maintenance-event" in r.error
    det = GcpMetadataDetector(gcp.url, ledger=NoticeLedger(None))
    det.MAINTENANCE_PATH = "/computeMetadata/v1/instance/no-such-key"  # the key may be absent
    assert poll_ok(det) == []
    assert preemption.GCP_MAINTENANCE_VALUES == ("NONE", "MIGRATE_ON_HOST_MAINTENANCE", "TERMINATE_ON_HOST_MAINTENANCE")


def test_mock_gcp_maintenance_event_long_poll(gcp):
    s = requests.Session()
    s.trust_env = False
    url = gcp.url + "/computeMetadata/v1/instance/maintenance-event"
    first = s.get(url, headers={"Metadata-Flavor": "Google"}, timeout=10)
    assert first.text == "NONE" and first.headers["Metadata-Flavor"] == "Google"
    th = threading.Timer(0.2, gcp.set_maintenance)
    th.start()
    second = s.get(
        url,
        headers={"Metadata-Flavor": "Google"},
        timeout=30,
        params={"wait_for_change": "true", "last_etag": first.headers["ETag"]},
    )
    th.join()
    assert second.text == "TERMINATE_ON_HOST_MAINTENANCE" and second.headers["ETag"] != first.headers["ETag"]
    with pytest.raises(ValueError, match="unknown maintenance-event"):
        gcp.set_maintenance("REBOOT")


# --- Azure: events naming other VMs (docs/preemption-notices.md §3.2) -------------------------------------
def test_azure_learns_its_name_and_ignores_other_vms(azure):
    det = AzureScheduledEventsDetector(azure.url, ledger=NoticeLedger(None))
    azure.issue_notice(event_id="NEIGHBOUR", resources=["spot-vm-1", "spot-vm-2"])
    assert poll_ok(det) == [] and det.vm_name == "spot-vm-0"
    azure.issue_notice(event_id="MINE", resources=["spot-vm-1", "Spot-VM-0"])
    [n] = poll_ok(det)
    assert n.key == "MINE"


def test_azure_unknown_name_is_unhealthy_not_a_notice(azure):
    azure.issue_notice(event_id="E1")
    det = AzureScheduledEventsDetector(azure.url, ledger=NoticeLedger(None), timeout_s=ROOMY)
    azure.inject_fault("503")  # IMDS compute/name fails: events are not judged yet
    r = det.poll(time.time())
    assert not r.healthy and r.notices == [] and "instance/compute/name" in r.error
    assert det.vm_name is None
    [n] = poll_ok(det)  # learns the name on the next poll
    assert n.key == "E1"


def test_mock_azure_compute_name_rules(azure):
    s = requests.Session()
    s.trust_env = False
    url = azure.url + "/metadata/instance/compute/name"
    assert s.get(url, params={"api-version": "2021-02-01"}, timeout=10).status_code == 400
    assert s.get(url, headers={"Metadata": "true"}, timeout=10).status_code == 400
    r = s.get(url, headers={"Metadata": "true"}, params={"api-version": "2021-02-01", "format": "text"}, timeout=10)
    assert (r.status_code, r.text) == (200, "spot-vm-0")
    r = s.get(url, headers={"Metadata": "true"}, params={"api-version": "2021-02-01"}, timeout=10)
    assert r.json() == "spot-vm-0"


# --- restart with an active notice (docs/preemption-notices.md §0 item 4) ---------------------------------
def test_known_notices_and_active_node_notice(aws, tmp_path):
    from agent.preemption import active_node_notice

    path = tmp_path / "ledger.json"
    aws.issue_notice(lead_time_s=90)
    [n] = poll_ok(AwsImdsDetector(aws.url, ledger=NoticeLedger(path)))
    r = AwsImdsDetector(aws.url, ledger=NoticeLedger(path)).poll(time.time())  # restarted agent
    assert r.notices == [] and [k.key for k in r.known] == [n.key]  # no second drain
    assert active_node_notice(r, time.time()) == r.known[0]
    assert active_node_notice(r, n.deadline_unix_s + 31) is None  # long past: stale
    aws.issue_rebalance()  # a hint never blocks a join
    aws.cancel_notice()
    aws.issue_rebalance()
    r = AwsImdsDetector(aws.url, ledger=NoticeLedger(None)).poll(time.time())
    assert [x.kind for x in r.notices] == ["rebalance"] and active_node_notice(r, time.time()) is None


# --- trickling metadata server: overall deadline ---------------------------------------------
@pytest.mark.parametrize("cloud", ["aws", "gcp", "azure"])
def test_trickling_metadata_is_cut_off_and_unhealthy(cloud):
    with MockMetadataServer(cloud) as m:
        m.trickle_interval_s = 0.2  # a byte every 0.2 s: each gap is far below the timeout
        # 3 s, not 1: on a loaded machine aws' token PUT alone once took over 1 s, and the poll
        # then failed on that timeout before the trickled answer began
        det = make_detector(cloud, m.url, ledger=NoticeLedger(None), timeout_s=3.0)
        m.inject_fault("trickle", count=5)
        r = det.poll(time.time())
        assert not r.healthy and f"{cloud}: " in r.error and "not complete within 3s" in r.error, r.error


def test_the_mock_server_prints_no_traceback_when_a_client_hangs_up(capsys):
    """Was: a ConnectionResetError traceback on `spotlight up --mock-cloud aws`'s console at exit."""
    with MockMetadataServer("aws") as m:
        for exc in (ConnectionResetError(104, "Connection reset by peer"), BrokenPipeError(32, "Broken pipe")):
            try:
                raise exc
            except OSError:
                m._server.handle_error(None, ("127.0.0.1", 1))
        assert capsys.readouterr().err == ""
        try:
            raise ValueError("a real bug")
        except ValueError:
            m._server.handle_error(None, ("127.0.0.1", 1))
        assert "ValueError: a real bug" in capsys.readouterr().err
