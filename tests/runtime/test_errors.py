from runtime.errors import MAX_CHECKPOINT_MESSAGE, CheckpointError


def test_a_checkpoint_message_quoting_a_long_value_keeps_its_start_and_its_end():
    message = "config.json: field 'hidden_size' should be int, got [" + "0, " * 100_000 + "0] (supported: x)"
    error = str(CheckpointError(message))
    assert len(error) < MAX_CHECKPOINT_MESSAGE + 100
    assert error.startswith("config.json: field 'hidden_size' should be int, got [0, 0,")
    assert error.endswith("0, 0] (supported: x)")
    assert f"... ({len(message) - MAX_CHECKPOINT_MESSAGE} characters left out) ..." in error


def test_a_checkpoint_message_of_ordinary_length_is_kept_whole():
    message = "x" * MAX_CHECKPOINT_MESSAGE
    assert str(CheckpointError(message)) == message
