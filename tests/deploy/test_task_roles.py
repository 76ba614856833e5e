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
Beat's leader writes and reads the model batches under `batch/` with beat's keys, and the
stand-in for Bedrock reads and writes them with the keys of the role Bedrock assumes for them
(`model-batch-policy.json`). Model and release call no S3 at all, and their policies grant no S3
action; beat's metrics report is sent with beat's keys (moto's name for CloudWatch's action:
`operation_names`).
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

from mailpipe.broker.queues import Lane
from mailpipe.classifiers.batch import BatchModel
from mailpipe.cli.ingest import store_emails
from mailpipe.enqueue import sender
from mailpipe.errors import BlobAccessDenied, BlobMissing, Dependency
from mailpipe.operations import actions, sinks
from mailpipe.operations.metrics import BacklogMetrics
from mailpipe.pipeline import batches, health, job
from mailpipe.pipeline.policy import Kind
from mailpipe.resources import Resources
from mailpipe.storage import flags
from mailpipe.storage.keys import document_texts
from mailpipe.storage.models import Document, EmailMessage, PipelineRun, RunStatus
from tests.support.bedrock_batch_server import BedrockBatchServer
from tests.support.cloudformation import resolved
from tests.support.document_samples import DOCX, docx_with_text
from tests.support.emails import raw_email
from tests.support.services import S3Server
from tests.support.waits import run_statuses

pytestmark = pytest.mark.services

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
# The policy files name the bucket and prefix of the worker's task definition.
BLOB_URL = "s3://mailpipe-blobs-123456789012/mail"
BUCKET, PREFIX = BLOB_URL.removeprefix("s3://").split("/", 1)
ROLES = ("worker", "web", "beat")
# The role Bedrock assumes for the model batches (its file: model-batch-policy.json).
BATCH_ROLE = "model-batch"
USERS = (*ROLES, BATCH_ROLE)
ADMIN_POLICY = {
    "Version": "2012-10-17",
    "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}],
}


def policy(role: str) -> dict[str, Any]:
    name = f"{role}-policy" if role == BATCH_ROLE else f"{role}-task-policy"
    return json.loads((DEPLOY / "iam" / f"{name}.json").read_text())


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

    def make(role: str, **settings: Any) -> Resources:
        for name, value in found[role].items():
            monkeypatch.setenv(name, value)
        monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
        role_res = Resources(
            res.settings.model_copy(
                update={
                    "blob_url": BLOB_URL,
                    "s3_endpoint_url": url,
                    "doc_inline_text_bytes": 0,
                    **settings,
                }
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


def test_beat_runs_a_model_batch_under_its_policy_and_bedrock_under_the_batch_role(
    res, as_role, keys, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    """Beat's leader writes a batch's input, reads its output and deletes both with beat's
    keys; the stand-in for Bedrock reads the input and writes the output with the batch role's.
    Neither reaches anything else."""
    url, found = keys
    batch_settings = {
        "model_backend": "bedrock",
        "model_batch": "on",
        "model_batch_role_arn": "arn:aws:iam::123456789012:role/mailpipe-model-batch",
        "model_batch_min": 2,
        "model_batch_size": 2,
        "model_batch_wait": 0,
    }
    with res.db.transaction() as session:
        flags.set_model_calls(session, True)
    admin = as_role("admin", **batch_settings)
    email_ids = store_emails(admin, [raw_email(f"invoice {i}") for i in range(2)], Lane.BULK)
    for email_id in email_ids:
        job.process_email(admin, email_id, lane=Lane.BULK)
        assert job.classify_email(admin, email_id, lane=Lane.BULK).kind is Kind.BATCHED
    with BedrockBatchServer(url, keys=found[BATCH_ROLE]) as bedrock:
        monkeypatch.setenv("AWS_ENDPOINT_URL_BEDROCK", bedrock.url)
        beat = as_role("beat", **batch_settings)
        model = BatchModel.from_settings(beat.settings)
        assert batches.tick(beat, sender(beat), model).submitted == 1
        assert batches.tick(beat, sender(beat), model).applied == 2
    assert set(run_statuses(res, email_ids).values()) == {"succeeded"}
    listed = admin.blobs.client.list_objects_v2(Bucket=BUCKET, Prefix=f"{PREFIX}/batch/")
    assert listed["KeyCount"] == 0

    # No more than that: beat reads no email and writes nothing outside `batch/`; the batch
    # role reads only inputs and writes only outputs.
    with res.db.session() as session:
        blob_key = session.get_one(EmailMessage, email_ids[0]).blob_key
    assert refused(lambda: beat.blobs.get(blob_key))
    assert refused(lambda: beat.blobs.put("text/1/0.txt", b"x"))
    batch_role = as_role(BATCH_ROLE)
    admin.blobs.put("batch/9/input/records.jsonl", b"{}")
    assert batch_role.blobs.get("batch/9/input/records.jsonl") == b"{}"
    batch_role.blobs.put("batch/9/output/job/records.jsonl.out", b"{}")
    assert refused(lambda: batch_role.blobs.put("batch/9/input/records.jsonl", b"x"))
    assert refused(lambda: batch_role.blobs.get("batch/9/output/job/records.jsonl.out"))
    assert refused(lambda: batch_role.blobs.get(blob_key))


def test_roles_without_blob_code_have_no_s3_action() -> None:
    assert s3_actions(policy("model")) == set()
    for name in ("release-execution-policy", "execution-common-policy"):
        assert s3_actions(json.loads((DEPLOY / "iam" / f"{name}.json").read_text())) == set()


# The template's role of each policy file.
TEMPLATE_ROLES = {
    **{role: f"{role.capitalize()}TaskRole" for role in ROLES},
    BATCH_ROLE: "ModelBatchRole",
}
# The parameters and pseudo-parameters the files are written for.
FILE_PARAMETERS = {
    "BlobBucketName": BUCKET,
    "BlobPrefix": PREFIX,
    "NamePrefix": "mailpipe",
    "BedrockRegion": "us-east-1",
    "BedrockModelId": "anthropic.claude-3-5-haiku-20241022-v1:0",
    "MetricsNamespace": "Mailpipe",
    "AWS::AccountId": "123456789012",
}
PSEUDO = {"${AWS::Partition}": "aws", "${AWS::AccountId}": "123456789012"}


def in_the_template(document: Any) -> Any:
    """`document`, a part of the template, resolved for the files' parameters."""
    text = json.dumps(resolved(document, FILE_PARAMETERS))
    for pseudo, value in PSEUDO.items():
        text = text.replace(pseudo, value)
    return json.loads(text)


@pytest.mark.parametrize("role", USERS)
def test_the_template_grants_each_role_what_its_policy_file_grants(role: str) -> None:
    """The stack's inline policy, resolved for the files' bucket and prefix, is the file's."""
    template, matches = decode(str(DEPLOY / "cloudformation" / "mailpipe.yaml"))
    assert not matches, matches
    resource = TEMPLATE_ROLES[role]
    [inline] = template["Resources"][resource]["Properties"]["Policies"]
    statements = in_the_template(inline["PolicyDocument"]["Statement"])

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
