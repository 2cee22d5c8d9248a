def score(response: str, ground_truth: str) -> dict:
    """Reverse the word: full credit for the exact reversal, partial credit for each
    character of the response that is a letter of the word."""
    answer = response.strip()
    if answer == ground_truth:
        return {"score": 1.0, "acc": 1.0}
    letters = [c for c in answer if c in ground_truth]
    partial = len(letters) / max(len(answer), 1)
    return {"score": 0.5 * partial, "acc": 0.0}
