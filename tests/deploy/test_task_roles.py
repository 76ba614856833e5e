"""Each role's code under its own task policy, as shipped, against an S3 server that enforces IAM.

moto's server runs with `INITIAL_NO_AUTH_ACTION_COUNT`: the requests that set it up (the bucket,
a user per role with the role's policy file verbatim as its inline policy, their keys) pass
unsigned, and every request after them is checked against the caller's policies, Action and
Resource alike. moto names the action by the API operation where S3 names two of them otherwise:
a listing is `s3:ListObjectsV2` there (IAM's `s3:ListBucket`), a batch delete `s3:DeleteObjects`
on the bucket (IAM's `s3:DeleteObject` on each key). Each role's user also gets those names for
what its file grants (`operation_names`), and nothing else; moto does not check the keys of a
batch delete against the policy, so the single deletes below are what shows each role's reach. The worker's jobs and its blob check then run with the worker's keys, and the
web role's forget with the web's, on the test's PostgreSQL and Redis. A policy that grants too
little fails a code path; one that grants too much fails the refusals asserted beside them.
Beat, model and release call no S3 at all, and their policies grant no S3 action; beat's
metrics report is sent with beat's keys (moto's name for CloudWatch's action: `operation_names`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.exceptions import ClientError
from cfnlint.decode import decode
from sqlalchemy import select

from mailpipe.cli.ingest import store_emails
from mailpipe.enqueue import sender
from mailpipe.errors import BlobAccessDenied, BlobMissing, Dependency
from mailpipe.operations import actions, sinks
from mailpipe.operations.metrics import BacklogMetrics
from mailpipe.pipeline import health, job
from mailpipe.pipeline.policy import Kind
from mailpipe.resources import Resources
from mailpipe.storage import flags
from mailpipe.storage.keys import document_texts
from mailpipe.storage.models import Document, EmailMessage, PipelineRun, RunStatus
from tests.support.cloudformation import resolved
from tests.support.document_samples import DOCX, docx_with_text
from tests.support.emails import raw_email
from tests.support.services import S3Server

pytestmark = pytest.mark.services

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
# The policy files name the bucket and prefix of the worker's task definition.
BLOB_URL = "s3://mailpipe-blobs-123456789012/mail"
BUCKET, PREFIX = BLOB_URL.removeprefix("s3://").split("/", 1)
ROLES = ("worker", "web")
# Beat calls no S3: its user is there for its CloudWatch report.
USERS = (*ROLES, "beat")
ADMIN_POLICY = {
    "Version": "2012-10-17",
    "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}],
}


def policy(role: str) -> dict[str, Any]:
    return json.loads((DEPLOY / "iam" / f"{role}-task-policy.json").read_text())


def operation_names(document: dict[str, Any]) -> dict[str, Any]:
    """What `document` grants, under the names moto checks for the same calls."""
    statements = []
    for statement in document["Statement"]:
        granted = statement["Action"]
        granted = [granted] if isinstance(granted, str) else granted
        resources = statement["Resource"]
        resources = [resources] if isinstance(resources, str) else resources
        if "s3:ListBucket" in granted:
            statements.append(
                {"Effect": "Allow", "Action": "s3:ListObjectsV2", "Resource": resources}
            )
        if "cloudwatch:PutMetricData" in granted:
            # moto names the action by CloudWatch's endpoint prefix, and hands a policy no
            # `cloudwatch:namespace` value: the same grant under moto's name, without the
            # namespace condition (which the template test holds), stands in for it.
            statements.append(
                {"Effect": "Allow", "Action": "monitoring:PutMetricData", "Resource": resources}
            )
        if "s3:DeleteObject" in granted:
            buckets = sorted({r.split("/", 1)[0] for r in resources})
            statements.append(
                {"Effect": "Allow", "Action": "s3:DeleteObjects", "Resource": buckets}
            )
    return {"Version": "2012-10-17", "Statement": statements}


def setup_requests() -> int:
    """The unsigned set-up: the bucket; a user, its policy and its key for the admin and for
    each role, and each role's operation names when it has any."""
    return 1 + 3 + sum(3 + bool(operation_names(policy(r))["Statement"]) for r in USERS)


def s3_actions(document: dict[str, Any]) -> set[str]:
    found: set[str] = set()
    for statement in document["Statement"]:
        actions_ = statement["Action"]
        found.update(
            a
            for a in ([actions_] if isinstance(actions_, str) else actions_)
            if a.startswith("s3:")
        )
    return found


@pytest.fixture(scope="module")
def keys(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[str, dict[str, dict[str, str]]]]:
    """The enforcing server's URL and each user's keys (`admin` seeds and inspects)."""
    os.environ["INITIAL_NO_AUTH_ACTION_COUNT"] = str(setup_requests())
    try:
        server = S3Server(tmp_path_factory.mktemp("iam") / "moto.log")
        server.start(BUCKET)
    finally:
        del os.environ["INITIAL_NO_AUTH_ACTION_COUNT"]
    iam = boto3.client(
        "iam",
        endpoint_url=server.url,
        aws_access_key_id="setup",
        aws_secret_access_key="setup",
        region_name="us-east-1",
    )
    found: dict[str, dict[str, str]] = {}
    for user, document in [("admin", ADMIN_POLICY), *((r, policy(r)) for r in USERS)]:
        iam.create_user(UserName=user)
        iam.put_user_policy(UserName=user, PolicyName=user, PolicyDocument=json.dumps(document))
        if user != "admin" and operation_names(document)["Statement"]:
            iam.put_user_policy(
                UserName=user,
                PolicyName="operation-names",
                PolicyDocument=json.dumps(operation_names(document)),
            )
        key = iam.create_access_key(UserName=user)["AccessKey"]
        found[user] = {
            "AWS_ACCESS_KEY_ID": key["AccessKeyId"],
            "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"],
        }
    try:
        yield server.url, found
    finally:
        server.stop()


@pytest.fixture
def as_role(res, keys, monkeypatch):  # type: ignore[no-untyped-def]
    """Resources of a role: the test's database and Redis, the enforcing S3 with its keys."""
    url, found = keys
    made: list[Resources] = []

    def make(role: str) -> Resources:
        for name, value in found[role].items():
            monkeypatch.setenv(name, value)
        monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
        role_res = Resources(
            res.settings.model_copy(
                update={"blob_url": BLOB_URL, "s3_endpoint_url": url, "doc_inline_text_bytes": 0}
            )
        )
        assert role_res.blobs is not None  # its client, made now with these keys
        made.append(role_res)
        return role_res

    health.forget()
    yield make
    health.forget()
    for each in made:
        each.close()


def an_email_with_a_document(tag: str) -> bytes:
    document = docx_with_text(f"the attached text {tag}")
    return raw_email(
        "with a document",
        to="b@example.org",
        message_id=f"{tag}@example.org",
        attachments=[("a.docx", DOCX, document)],
    )


def refused(call: Any) -> bool:
    try:
        call()
    except (BlobAccessDenied, ClientError):
        return True
    return False


def test_the_worker_runs_its_jobs_and_its_check_under_its_own_policy(res, as_role) -> None:  # type: ignore[no-untyped-def]
    admin, worker = as_role("admin"), as_role("worker")
    [email_id] = store_emails(admin, [an_email_with_a_document("worker")])
    with res.db.transaction() as session:
        flags.set_model_calls(session, True)

    assert health.check(worker, Dependency.BLOBS).passed  # writes, reads, deletes its object
    assert job.process_email(worker, email_id).kind is Kind.SUCCEEDED
    with res.db.session() as session:
        [text_key] = session.scalars(select(Document.text_blob_key)).all()
        blob_key = session.get_one(EmailMessage, email_id).blob_key
    assert text_key and b"the attached text worker" in admin.blobs.get(text_key)
    worker.blobs.delete(text_key)  # the texts of an email forgotten while its job ran

    # No more than that: no raw email written or deleted, no text read back.
    assert refused(lambda: worker.blobs.put("raw/" + "0" * 64, b"x"))
    assert refused(lambda: worker.blobs.delete(blob_key))
    admin.blobs.put(text_key, b"text")
    assert refused(lambda: worker.blobs.get(text_key))


def test_a_missing_raw_email_fails_its_own_run_under_the_worker_s_policy(res, as_role) -> None:  # type: ignore[no-untyped-def]
    """With its listing of the prefix the role is told 404, the email's own fault: its run
    fails at once and the stage is not judged out."""
    admin, worker = as_role("admin"), as_role("worker")
    [email_id] = store_emails(admin, [an_email_with_a_document("missing")])
    with res.db.session() as session:
        admin.blobs.delete(session.get_one(EmailMessage, email_id).blob_key)
    assert job.process_email(worker, email_id).kind is Kind.FAILED
    with res.db.session() as session:
        run = session.scalars(select(PipelineRun)).one()
    assert (run.status, run.error_class) == (RunStatus.FAILED, "BlobMissing")


def test_the_web_role_forgets_under_its_own_policy(res, as_role) -> None:  # type: ignore[no-untyped-def]
    admin, worker = as_role("admin"), as_role("worker")
    read, unread = store_emails(
        admin, [an_email_with_a_document("read"), an_email_with_a_document("unread")]
    )
    with res.db.transaction() as session:
        flags.set_model_calls(session, True)
    assert job.process_email(worker, read).kind is Kind.SUCCEEDED
    with res.db.session() as session:
        raw_keys = list(session.scalars(select(EmailMessage.blob_key)))
    texts = admin.blobs.client.list_objects_v2(
        Bucket=BUCKET, Prefix=f"{PREFIX}/{document_texts(read)}"
    )
    assert texts["KeyCount"] == 1

    web = as_role("web")
    forgotten = actions.forget(web, [read, unread], enqueue=sender(web), user="operator")
    assert sorted(forgotten.email_ids) == sorted([read, unread])
    with res.db.session() as session:
        assert session.scalars(select(EmailMessage.id)).all() == []
    listed = admin.blobs.client.list_objects_v2(Bucket=BUCKET, Prefix=f"{PREFIX}/")
    left = {o["Key"] for o in listed.get("Contents", [])}
    assert not left & {f"{PREFIX}/{key}" for key in raw_keys}
    assert not {key for key in left if key.startswith(f"{PREFIX}/{document_texts(read)}")}
    for key in raw_keys:
        with pytest.raises(BlobMissing):
            admin.blobs.get(key)
    # No more than that: the web role writes nothing.
    assert refused(lambda: web.blobs.put("raw/" + "1" * 64, b"x"))
    assert refused(lambda: web.blobs.put("text/1/0.txt", b"x"))


def test_roles_without_blob_code_have_no_s3_action() -> None:
    for role in ("beat", "model"):
        assert s3_actions(policy(role)) == set(), role
    for name in ("release-execution-policy", "execution-common-policy"):
        assert s3_actions(json.loads((DEPLOY / "iam" / f"{name}.json").read_text())) == set()


@pytest.mark.parametrize("role", ROLES)
def test_the_template_grants_each_role_what_its_policy_file_grants(role: str) -> None:
    """The stack's inline policy, resolved for the files' bucket and prefix, is the file's."""
    template, matches = decode(str(DEPLOY / "cloudformation" / "mailpipe.yaml"))
    assert not matches, matches
    resource = f"{role.capitalize()}TaskRole"
    [inline] = template["Resources"][resource]["Properties"]["Policies"]
    parameters = {"BlobBucketName": BUCKET, "BlobPrefix": PREFIX}
    in_template = json.dumps(resolved(inline["PolicyDocument"]["Statement"], parameters))
    statements = json.loads(in_template.replace("${AWS::Partition}", "aws"))

    def normal(items: list[dict[str, Any]]) -> dict[str, Any]:
        def listed(value: Any) -> list[str]:
            return sorted(value if isinstance(value, list) else [value])

        return {
            s["Sid"]: (s["Effect"], listed(s["Action"]), listed(s["Resource"]), s.get("Condition"))
            for s in items
        }

    assert normal(statements) == normal(resolved(policy(role)["Statement"], {}))


def test_beat_sends_the_metrics_report_under_its_own_policy(keys, monkeypatch, caplog) -> None:  # type: ignore[no-untyped-def]
    """The report's PutMetricData with beat's keys, into the namespace its policy names; the
    worker's keys, whose policy grants no CloudWatch action, are refused."""
    url, found = keys
    reading = BacklogMetrics(queue="mailpipe", queue_depth=4, oldest_job_age_s=2.0, running_tasks=2)

    def sent(user: str) -> bool:
        for name, value in found[user].items():
            monkeypatch.setenv(name, value)
        monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
        caplog.clear()
        sinks.CloudWatchSink("Mailpipe", url).send([reading])  # its client made with these keys
        return "PutMetricData failed" not in caplog.text

    assert sent("beat")
    assert not sent("worker")
