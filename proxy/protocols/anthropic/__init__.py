"""The Anthropic Messages API adapter's pieces: the request read as neutral messages, its
translation to and from Chat Completions (whole and streamed), and errors in its shape."""
