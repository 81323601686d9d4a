"""The arithmetic verifier: the last `Answer: n` of a completion, graded against the task."""

from ptrain.data.tasks import check_answer, extract_answer


def test_extract_answer_edge_cases():
    assert extract_answer("no answer here") is None
    assert extract_answer("Answer: 007") == "7"
    assert extract_answer("Answer: 1\nAnswer: 22 and more") == "22"
    assert extract_answer("Answer:-5") == "-5"
    task = {"answer": "936"}
    assert check_answer(task, "...\nAnswer: 936")
    assert not check_answer(task, "...\nAnswer: 935")
    assert not check_answer(task, "936")
