"""tokenmill.chat.layout: a system prompt split into what sessions share and the lines
of its own session, the same text either way."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from tokenmill.chat import SystemBlock, SystemSplit, split_system
from tokenmill.chat.layout import SESSION_SECTIONS

ENVIRONMENT = "# Environment\nYou have been invoked in the following environment: \n - cwd: /a"
MEMORY = "# Memory\n\nYou have a persistent file-based memory at `/a/memory/`.\n\nOne fact a file."
GIT = "gitStatus: This is the git status.\n\nCurrent branch: main"


def words(text: str) -> list[str]:
    return sorted(text.split())


def test_text_without_session_lines_stays_as_it_is() -> None:
    blocks = [SystemBlock("You are helpful."), SystemBlock("# Rules\nBe brief.\n\n# More\nok")]
    stable = "You are helpful.\n\n# Rules\nBe brief.\n\n# More\nok"
    assert split_system(blocks) == SystemSplit(stable, "")


def test_sections_move_to_the_end_the_billing_header_last_and_the_rest_closes_up() -> None:
    text = f"\nYou code.\n\n{MEMORY}\n\n{ENVIRONMENT}\n\n# Context\nSummaries.\n\n{GIT}"
    header = "x-anthropic-billing-header: cc_version=2.1.197.7e2;"
    split = split_system([SystemBlock(header), SystemBlock("Agent."), SystemBlock(text, True)])
    assert split.stable == "Agent.\n\n\nYou code.\n\n# Context\nSummaries."
    # The header changes with every first message, the others with the project: last.
    assert split.session == "\n\n".join([MEMORY, ENVIRONMENT, GIT, header])


def test_blocks_after_the_last_breakpoint_move_whole() -> None:
    blocks = [
        SystemBlock("Stable."),
        SystemBlock("Also stable.", breakpoint=True),
        SystemBlock("The time is 12:04."),
        SystemBlock("The user is Ada."),
    ]
    split = split_system(blocks)
    assert split == SystemSplit("Stable.\n\nAlso stable.", "The time is 12:04.\n\nThe user is Ada.")


def test_an_opening_inside_a_line_is_no_section() -> None:
    text = "Say gitStatus: when asked. # Environment\nYou have been invoked in the following"
    assert split_system([SystemBlock(text)]) == SystemSplit(text, "")


@given(
    st.lists(
        st.tuples(
            st.lists(
                st.sampled_from([*SESSION_SECTIONS, "# Other", "text", "\n", "\n\n", " a b"]),
                max_size=8,
            ),
            st.booleans(),
        ),
        max_size=5,
    )
)
def test_the_same_words_either_way(drawn: list[tuple[list[str], bool]]) -> None:
    blocks = [SystemBlock("".join(parts), mark) for parts, mark in drawn]
    split = split_system(blocks)
    assert words(split.stable + " " + split.session) == words(" ".join(b.text for b in blocks))
    if not any(b.breakpoint for b in blocks) and not split.session:
        assert split.stable == "\n\n".join(b.text for b in blocks if b.text)
