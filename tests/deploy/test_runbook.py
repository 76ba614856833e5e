"""Every alarm of the template links its runbook section in docs/operations.md, and every section
of the runbook is some alarm's.

Pure: the template read with cfn-lint's decoder (which understands `!Sub` and the other short
forms), the page read as text. No AWS call.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from cfnlint.decode import decode

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = ROOT / "deploy" / "cloudformation" / "mailpipe.yaml"
RUNBOOK = ROOT / "docs" / "operations.md"
ALARMS_HEADING = "Alarms"
ALARM_TYPES = {"AWS::CloudWatch::Alarm", "AWS::CloudWatch::CompositeAlarm"}
# A link in an alarm's description: the page's URL, a parameter of the stack, then an anchor.
LINK = re.compile(r"\$\{RunbookUrl\}#([^\s)]+)")
# CloudWatch refuses a longer AlarmDescription.
DESCRIPTION_MAX = 1024
# The longest value each substitution can take, where the template does not bound it itself:
# NamePrefix by its AllowedPattern (31 characters), ClusterName by ECS (255).
LONGEST = {"NamePrefix": 31, "ClusterName": 255}
FENCE = re.compile(r"^\s*(```|~~~)")


@pytest.fixture(scope="module")
def template() -> dict:
    tpl, matches = decode(str(TEMPLATE))
    assert not matches, matches
    return tpl


def alarms(template: dict) -> dict[str, dict]:
    return {
        name: resource["Properties"]
        for name, resource in template["Resources"].items()
        if resource["Type"] in ALARM_TYPES
    }


def description(props: dict) -> str:
    """The alarm's description as written: a `!Sub` string, whose `${RunbookUrl}` it links."""
    text = props.get("AlarmDescription")
    assert isinstance(text, dict) and set(text) == {"Fn::Sub"}, text
    assert isinstance(text["Fn::Sub"], str), text
    return text["Fn::Sub"]


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: its text lowercased, every character but letters,
    digits, `_`, `-` and spaces dropped (backticks, colons, apostrophes...), spaces made `-`."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def headings(page: str) -> list[tuple[int, str, str]]:
    """(level, title, anchor) of each heading of the page, outside fenced code, in order. A title
    met again gets GitHub's suffix (`-1`, `-2`...)."""
    found: list[tuple[int, str, str]] = []
    seen: dict[str, int] = {}
    fenced = False
    for line in page.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        heading = re.match(r"(#{1,6}) (.+?)\s*#*\s*$", line)
        if fenced or heading is None:
            continue
        anchor = github_anchor(heading.group(2))
        count = seen.get(anchor, 0)
        seen[anchor] = count + 1
        found.append(
            (len(heading.group(1)), heading.group(2), f"{anchor}-{count}" if count else anchor)
        )
    return found


def runbook_sections(page: str) -> dict[str, str]:
    """anchor: title of each `###` section under the `## Alarms` heading."""
    sections: dict[str, str] = {}
    inside = False
    for level, title, anchor in headings(page):
        if level <= 2:
            inside = level == 2 and title == ALARMS_HEADING
        elif level == 3 and inside:
            sections[anchor] = title
    return sections


def links(template: dict) -> dict[str, list[str]]:
    """alarm: the anchors its description links."""
    return {name: LINK.findall(description(props)) for name, props in alarms(template).items()}


def test_github_anchor_follows_github_s_rule():
    """Guards the checks below with anchors GitHub gives such headings."""
    assert github_anchor("Outages: a stage paused") == "outages-a-stage-paused"
    assert github_anchor("Scaling out on the live lane's wait") == (
        "scaling-out-on-the-live-lanes-wait"
    )
    assert github_anchor("Running the CLI in production: ECS Exec") == (
        "running-the-cli-in-production-ecs-exec"
    )
    assert github_anchor("`StagePaused` and `MAILPIPE_PAUSE_WINDOW`, 60 s") == (
        "stagepaused-and-mailpipe_pause_window-60-s"
    )
    page = "# Title\n## Same\n```\n## Not a heading\n```\n### Same\n"
    assert [anchor for _, _, anchor in headings(page)] == ["title", "same", "same-1"]


def test_the_runbook_has_sections():
    """Guards the checks below: a heading renamed away would leave them nothing to check."""
    assert len(runbook_sections(RUNBOOK.read_text())) >= 5


def test_the_template_has_alarms(template):
    assert len(alarms(template)) >= 10


def test_every_alarm_links_one_section_of_the_runbook(template):
    sections = runbook_sections(RUNBOOK.read_text())
    unlinked = {name: found for name, found in links(template).items() if len(found) != 1}
    assert not unlinked, f"each alarm's description links one section: {unlinked}"
    missing = {name: anchor for name, [anchor] in links(template).items() if anchor not in sections}
    assert not missing, (
        f"anchors that name no section under '## {ALARMS_HEADING}' of {RUNBOOK.name}: {missing}; "
        f"its sections are {sorted(sections)}"
    )


def test_every_section_of_the_runbook_is_linked_from_an_alarm(template):
    linked = {anchor for found in links(template).values() for anchor in found}
    orphans = {
        anchor: title
        for anchor, title in runbook_sections(RUNBOOK.read_text()).items()
        if anchor not in linked
    }
    assert not orphans, f"runbook sections no alarm links: {orphans}"


def test_the_runbook_url_is_a_parameter_for_the_page_without_an_anchor(template):
    parameter = template["Parameters"]["RunbookUrl"]
    assert parameter["Type"] == "String"
    assert parameter["Default"].startswith("https://")
    assert parameter["Default"].endswith("/docs/operations.md")
    pattern = re.compile(parameter["AllowedPattern"])
    assert pattern.fullmatch(parameter["Default"])
    assert not pattern.fullmatch(parameter["Default"] + "#alarms")
    [alarm_group] = [
        group
        for group in template["Metadata"]["AWS::CloudFormation::Interface"]["ParameterGroups"]
        if group["Label"]["default"] == "Alarms"
    ]
    assert "RunbookUrl" in alarm_group["Parameters"]


def test_every_description_fits_cloudwatch(template):
    """Each description with every substitution at its longest value."""
    too_long = {
        name: size
        for name in alarms(template)
        if (size := longest_description(template, name)) > DESCRIPTION_MAX
    }
    assert not too_long, too_long


def longest_description(template: dict, alarm: str) -> int:
    text = description(alarms(template)[alarm])
    longest = LONGEST | {"RunbookUrl": template["Parameters"]["RunbookUrl"]["MaxLength"]}
    names = re.findall(r"\$\{([^}]+)\}", text)
    assert set(names) <= set(longest), f"no longest value known for {set(names) - set(longest)}"
    return len(re.sub(r"\$\{([^}]+)\}", lambda m: "x" * longest[m[1]], text))
