"""Blob retention: the template's `BlobRetention` puts the stack's one lifecycle rule on the blob
prefix into a bucket it does not own, and takes it out again, leaving every other rule as it was.

Its inline function runs here as Lambda would run it, on CloudFormation's event, against moto's
S3 server on loopback (through `AWS_ENDPOINT_URL_S3`, which boto3 honours), and answers a loopback
server standing in for the presigned URL CloudFormation waits on.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.exceptions import ClientError
from cfnlint.decode import decode

from tests.conftest import S3_PORT
from tests.support.cloudformation import function_of, invoke, responses

pytestmark = pytest.mark.services

TEMPLATE = Path(__file__).resolve().parents[2] / "deploy" / "cloudformation" / "mailpipe.yaml"
RESOURCE = "BlobRetention"
# The stack's rule at the template's defaults (NamePrefix mailpipe, BlobPrefix mail).
RULE_ID = "mailpipe-blob-retention"
# A rule of the bucket's owner, which the stack must never touch.
OWNERS = {
    "ID": "owner-logs",
    "Filter": {"Prefix": "logs/"},
    "Status": "Enabled",
    "Expiration": {"Days": 90},
}


@pytest.fixture(scope="module")
def template() -> dict:
    tpl, matches = decode(str(TEMPLATE))
    assert not matches, matches
    return tpl


@pytest.fixture
def s3(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The function's boto3 reaches the S3 server; the test's client too."""
    endpoint = f"http://127.0.0.1:{S3_PORT}"
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    return boto3.client("s3", endpoint_url=endpoint)


@pytest.fixture
def bucket(s3: Any) -> str:
    """A bucket of the test's own, without a lifecycle configuration."""
    name = f"retention-{uuid.uuid4().hex[:12]}"
    s3.create_bucket(Bucket=name)
    return name


@pytest.fixture
def retention(template, s3):  # type: ignore[no-untyped-def]
    """Run the function on an event of `request_type` for `bucket` with the template's defaults
    and `parameters`; returns the answer CloudFormation received."""
    function = function_of(template, "BlobRetentionFunction")
    with responses() as taken:

        def run(request_type: str, bucket: str, **parameters: Any) -> dict:
            values = {"BlobBucketName": bucket} | parameters
            _, answer = invoke(
                template, function, RESOURCE, taken, request_type, values, f"{bucket}/{RULE_ID}"
            )
            return answer

        yield run


def rules(s3: Any, bucket: str) -> list[dict] | None:
    """The bucket's lifecycle rules, None without a configuration."""
    try:
        return s3.get_bucket_lifecycle_configuration(Bucket=bucket)["Rules"]
    except ClientError as exc:
        assert exc.response["Error"]["Code"] == "NoSuchLifecycleConfiguration"
        return None


def ours(days: int) -> dict:
    return {
        "ID": RULE_ID,
        "Filter": {"Prefix": "mail/"},
        "Status": "Enabled",
        "Expiration": {"Days": days},
    }


def test_the_default_keeps_the_blobs(template) -> None:  # type: ignore[no-untyped-def]
    assert template["Parameters"]["BlobRetentionDays"]["Default"] == 0


def test_a_create_adds_the_rule_and_keeps_the_bucket_s_other_rules(s3, bucket, retention) -> None:  # type: ignore[no-untyped-def]
    s3.put_bucket_lifecycle_configuration(Bucket=bucket, LifecycleConfiguration={"Rules": [OWNERS]})
    before = rules(s3, bucket)

    answer = retention("Create", bucket, BlobRetentionDays=30)
    assert answer["Status"] == "SUCCESS", answer["Reason"]
    assert answer["PhysicalResourceId"] == f"{bucket}/{RULE_ID}"
    assert rules(s3, bucket) == [*before, ours(30)]

    # An update replaces the rule in place.
    answer = retention("Update", bucket, BlobRetentionDays=400)
    assert answer["Status"] == "SUCCESS", answer["Reason"]
    assert rules(s3, bucket) == [*before, ours(400)]


def test_an_update_to_0_days_takes_out_only_its_rule(s3, bucket, retention) -> None:  # type: ignore[no-untyped-def]
    s3.put_bucket_lifecycle_configuration(Bucket=bucket, LifecycleConfiguration={"Rules": [OWNERS]})
    before = rules(s3, bucket)
    assert retention("Create", bucket, BlobRetentionDays=30)["Status"] == "SUCCESS"

    answer = retention("Update", bucket, BlobRetentionDays=0)
    assert answer["Status"] == "SUCCESS", answer["Reason"]
    assert rules(s3, bucket) == before


def test_a_delete_takes_out_its_rule_and_a_configuration_left_empty(s3, bucket, retention) -> None:  # type: ignore[no-untyped-def]
    assert retention("Create", bucket, BlobRetentionDays=30)["Status"] == "SUCCESS"
    assert rules(s3, bucket) == [ours(30)]

    answer = retention("Delete", bucket, BlobRetentionDays=30)
    assert answer["Status"] == "SUCCESS", answer["Reason"]
    assert rules(s3, bucket) is None


def test_a_bucket_without_a_configuration_keeps_none_at_0_days(s3, bucket, retention) -> None:  # type: ignore[no-untyped-def]
    for request in ("Create", "Update", "Delete"):
        answer = retention(request, bucket)
        assert answer["Status"] == "SUCCESS", answer["Reason"]
        assert rules(s3, bucket) is None


def test_an_error_fails_the_resource_with_its_reason_and_a_delete_never_sticks(retention) -> None:  # type: ignore[no-untyped-def]
    missing = f"retention-missing-{uuid.uuid4().hex[:8]}"
    for request in ("Create", "Update"):
        answer = retention(request, missing, BlobRetentionDays=30)
        assert answer["Status"] == "FAILED"
        assert answer["Reason"].startswith("NoSuchBucket: ")
        assert "GetBucketLifecycleConfiguration" in answer["Reason"]

    answer = retention("Delete", missing, BlobRetentionDays=30)
    assert answer["Status"] == "SUCCESS"
    assert "NoSuchBucket" in answer["Reason"]


def test_the_function_may_only_read_and_write_the_bucket_s_lifecycle(template) -> None:  # type: ignore[no-untyped-def]
    role = template["Resources"]["BlobRetentionRole"]["Properties"]
    (policy,) = role["Policies"]
    statements = {s["Sid"]: s for s in policy["PolicyDocument"]["Statement"]}
    assert set(statements) == {"BucketLifecycle", "WriteLogs"}
    lifecycle = statements["BucketLifecycle"]
    assert lifecycle["Action"] == ["s3:GetLifecycleConfiguration", "s3:PutLifecycleConfiguration"]
    assert lifecycle["Resource"] == {"Fn::Sub": "arn:${AWS::Partition}:s3:::${BlobBucketName}"}
    assert statements["WriteLogs"]["Resource"] == {"Fn::GetAtt": ["LogGroup", "Arn"]}
