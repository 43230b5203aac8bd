"""deploy/ as it is: real nginx with deploy/nginx/turbospark.conf, redis-server with
deploy/redis/turbospark.conf, and two replicas started as deploy/systemd/turbospark@.service says
(its ExecStart, Environment and EnvironmentFile; only paths, the model and the key file differ), all on
loopback with stories260K. A conversation chained with previous_response_id stays on one replica
and survives that replica's SIGKILL, every replica finds every key's own responses and no other
key's, another key's identical prompt misses the cache, and Redis stopped mid-run is a 503 naming
the store until it is back."""
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from types import SimpleNamespace

import pytest

from ops_servers import REPO, ReplicaNginx, Server, free_port, models_dir_with_stories, request

pytestmark = [pytest.mark.integration, pytest.mark.slow]

DEPLOY = REPO / "deploy"
UNIT = DEPLOY / "systemd" / "turbospark@.service"
ENV_FILE = DEPLOY / "systemd" / "turbospark.env"
KEYS = {"alice": "sk-deploy-alice-01", "bob": "sk-deploy-bob-02"}
VENV_TURBOSPARK = "/opt/turbospark/.venv/bin/turbospark"
LONG = "Once upon a time there was a little girl who liked to play in the park. " * 8


def read_env_file(path):
    pairs = (line.split("=", 1) for line in path.read_text().splitlines() if line.strip() and line[0] != "#")
    return {k.strip(): v.strip() for k, v in pairs}


def unit_command(port):
    """(argv, environment) of turbospark@<port>.service as systemd starts it: Environment= lines,
    then EnvironmentFile= over them, %i and %H expanded; the venv's `turbospark` is this
    interpreter's `python -m turbospark_wsgi` (the same entry point)."""
    environment, argv = {}, None
    for line in UNIT.read_text().splitlines():
        key, _, value = line.partition("=")
        value = value.replace("%i", str(port)).replace("%H", socket.gethostname())
        if key == "Environment":
            name, _, setting = value.partition("=")
            environment[name] = setting
        elif key == "EnvironmentFile":
            assert value == "/etc/turbospark/turbospark.env"
            from_file = read_env_file(ENV_FILE)
        elif key == "ExecStart":
            argv = value.split()
    assert argv[0] == VENV_TURBOSPARK
    return [sys.executable, "-m", "turbospark_wsgi", *argv[1:]], {**environment, **from_file}


@pytest.fixture(scope="module")
def deployment(tmp_path_factory, start_redis):
    store = start_redis(conf=DEPLOY / "redis" / "turbospark.conf")
    work = tmp_path_factory.mktemp("deploy")
    keys = work / "keys"
    keys.write_text("\n".join(KEYS.values()) + "\n")
    here = {"TURBOSPARK_MODELS": str(models_dir_with_stories(work / "models")), "TURBOSPARK_MODEL": "stories",
            "TURBOSPARK_API_KEY_FILE": str(keys), "TURBOSPARK_REDIS": store.url, "TURBOSPARK_DEVICE": "cpu",
            "HOME": os.environ.get("HOME", str(work))}
    replicas = {}
    try:
        for port in (free_port(), free_port()):
            argv, env = unit_command(port)
            assert env["TURBOSPARK_REDIS"] and env["TURBOSPARK_CACHE_ISOLATION"] == "key"
            srv = Server(work, argv=argv, port=port, env={**env, **here}, max_batch=4)
            replicas[env["TURBOSPARK_REPLICA_ID"]] = srv
        for srv in replicas.values():
            srv.wait_ready()
        nginx = ReplicaNginx(work, DEPLOY / "nginx" / "turbospark.conf", [s.port for s in replicas.values()])
        yield SimpleNamespace(nginx=nginx, replicas=replicas, store=store, chain=[], served_by=None)
        nginx.stop()
    finally:
        for srv in replicas.values():
            srv.stop()


def sdk(deployment, who, **headers):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=f"http://127.0.0.1:{deployment.nginx.port}/v1", api_key=KEYS[who],
                         max_retries=0, timeout=60, default_headers=headers)


def turn(client, text, previous=None):
    """One Responses turn; (response, replica that answered)."""
    raw = client.responses.with_raw_response.create(model="stories", input=text, previous_response_id=previous,
                                                    max_output_tokens=4, temperature=0)
    return raw.parse(), raw.headers["x-turbospark-replica"]


def call(port, method, path, who, body=None, **headers):
    status, heads, raw = request(port, method, path, body, headers={"Authorization": f"Bearer {KEYS[who]}",
                                                                    **headers})
    return status, heads, json.loads(raw) if raw else None


def test_the_systemd_unit_verifies(tmp_path):
    analyze = shutil.which("systemd-analyze")
    turbospark = shutil.which("turbospark", path=os.path.dirname(sys.executable))
    if analyze is None or turbospark is None:
        pytest.skip("systemd-analyze or the installed `turbospark` command absent")
    text = UNIT.read_text().replace(VENV_TURBOSPARK, turbospark).replace("/opt/turbospark", str(REPO))
    text = text.replace("/etc/turbospark/turbospark.env", str(ENV_FILE))
    (tmp_path / "turbospark@8001.service").write_text(text)
    done = subprocess.run([analyze, "verify", str(tmp_path / "turbospark@8001.service")], capture_output=True,
                          text=True, timeout=60)
    problems = [line for line in (done.stdout + done.stderr).splitlines() if "turbospark@" in line]
    assert done.returncode == 0 and not problems, done.stdout + done.stderr


def test_a_five_turn_chain_through_nginx_stays_on_one_replica(deployment):
    client = sdk(deployment, "alice", **{"x-session-affinity": "conversation-1"})
    previous, seen, inputs = None, set(), []
    for i in range(5):
        response, replica = turn(client, f"Turn {i}.", previous)
        assert response.output and response.previous_response_id == previous
        previous = response.id
        seen.add(replica)
        inputs.append(response.usage.input_tokens)
        deployment.chain.append(response.id)
    assert len(seen) == 1 and inputs == sorted(inputs) and len(set(inputs)) == 5   # each turn carries the last
    deployment.served_by = seen.pop()
    # without the header the key decides: bob's turns stay together too
    replicas = {turn(sdk(deployment, "bob"), f"bob {i}")[1] for i in range(3)}
    assert len(replicas) == 1


def test_get_and_delete_work_from_either_replica(deployment):
    ports = [srv.port for srv in deployment.replicas.values()]
    for port in ports:
        status, _, body = call(port, "GET", f"/v1/responses/{deployment.chain[0]}", "alice")
        assert status == 200 and body["id"] == deployment.chain[0]
    status, _, body = call(deployment.nginx.port, "POST", "/v1/responses", "alice",
                           {"model": "stories", "input": "to delete", "max_output_tokens": 4})
    assert status == 200
    assert call(ports[0], "DELETE", f"/v1/responses/{body['id']}", "alice")[2]["deleted"] is True
    assert call(ports[1], "GET", f"/v1/responses/{body['id']}", "alice")[0] == 404


def test_another_key_gets_the_404_of_an_unknown_id(deployment):
    port, mine, unknown = deployment.nginx.port, deployment.chain[-1], "resp_" + "0" * 48

    def refusals(rid):
        answers = [call(port, "GET", f"/v1/responses/{rid}", "bob"),
                   call(port, "DELETE", f"/v1/responses/{rid}", "bob"),
                   call(port, "POST", "/v1/responses", "bob", {"model": "stories", "input": "go on",
                                                              "previous_response_id": rid})]
        assert [a[0] for a in answers] == [404, 404, 404]
        return json.loads(json.dumps([a[2] for a in answers]).replace(rid, "ID"))

    assert refusals(mine) == refusals(unknown)
    assert call(port, "GET", f"/v1/responses/{mine}", "alice")[0] == 200       # still there for alice


def test_with_isolation_another_keys_identical_prompt_misses_the_cache(deployment):
    body = {"model": "stories", "messages": [{"role": "user", "content": LONG}], "max_tokens": 4, "temperature": 0}
    same_replica = {"x-session-affinity": "one-replica-for-both"}

    def ask(who):
        status, heads, doc = call(deployment.nginx.port, "POST", "/v1/chat/completions", who, body, **same_replica)
        assert status == 200
        srv = next(s for rid, s in deployment.replicas.items() if rid == heads["x-turbospark-replica"])
        return doc["usage"]["prompt_tokens_details"]["cached_tokens"], srv

    def hits(srv):
        return srv.metric("turbospark_prefix_cache_hits_total", headers={"Authorization": f"Bearer {KEYS['alice']}"})

    _, srv = ask("alice")
    before = hits(srv)
    cached, _ = ask("alice")
    assert cached > 0 and hits(srv) == before + 1
    cached, other = ask("bob")
    assert other is srv and cached == 0 and hits(srv) == before + 1        # bob cannot time alice's prompt
    assert ask("bob")[0] > 0 and hits(srv) == before + 2


def test_the_chain_survives_a_sigkill_of_its_replica(deployment):
    victim = deployment.replicas[deployment.served_by]
    os.killpg(victim.proc.pid, signal.SIGKILL)          # master and worker, no goodbye
    victim.proc.wait(10)
    client = sdk(deployment, "alice", **{"x-session-affinity": "conversation-1"})
    for i in range(2):
        response, replica = turn(client, f"After {i}.", deployment.chain[-1])
        assert replica != deployment.served_by and response.previous_response_id == deployment.chain[-1]
        deployment.chain.append(response.id)


def test_redis_stopped_mid_run_is_a_503_naming_the_store_and_it_recovers(deployment):
    port, store = deployment.nginx.port, deployment.store
    store.stop()
    where = f"response store (Redis at 127.0.0.1:{store.port}/0)"
    answers = [call(port, "POST", "/v1/responses", "alice", {"model": "stories", "input": "more",
                                                             "previous_response_id": deployment.chain[-1]}),
               call(port, "POST", "/v1/responses", "alice", {"model": "stories", "input": "new"}),
               call(port, "GET", f"/v1/responses/{deployment.chain[-1]}", "alice")]
    for status, heads, body in answers:
        assert status == 503 and heads["retry-after"], body
        assert body["error"]["code"] == "store_unavailable" and where in body["error"]["message"]
    assert store.start()                                 # its append-only file brings the chain back
    client = sdk(deployment, "alice", **{"x-session-affinity": "conversation-1"})
    response, _ = turn(client, "Back again.", deployment.chain[-1])
    assert response.previous_response_id == deployment.chain[-1]
    assert call(port, "GET", f"/v1/responses/{deployment.chain[0]}", "alice")[0] == 200


def test_gevent_replicas_share_the_store_and_say_when_it_is_gone(tmp_path, start_redis):
    store = start_redis()
    keys = tmp_path / "keys"
    keys.write_text(KEYS["alice"] + "\n")
    models = models_dir_with_stories(tmp_path / "models")
    replicas = [Server(tmp_path, worker_class="gevent", models=models, model="stories", api_key_file=keys,
                       redis=store.url) for _ in range(2)]
    try:
        for srv in replicas:
            srv.wait_ready()
        status, _, body = call(replicas[0].port, "POST", "/v1/responses", "alice",
                               {"input": "hi", "max_output_tokens": 2})
        assert status == 200
        assert call(replicas[1].port, "GET", f"/v1/responses/{body['id']}", "alice")[2]["id"] == body["id"]
        store.stop()
        status, _, refused = call(replicas[1].port, "GET", f"/v1/responses/{body['id']}", "alice")
        assert status == 503 and refused["error"]["code"] == "store_unavailable"
    finally:
        for srv in replicas:
            srv.stop()
