"""Emails built for tests: shapes that real mail only rarely has."""


def nested_multipart(levels: int) -> bytes:
    head = b"".join(
        b'Content-Type: multipart/mixed; boundary="b%d"\r\n\r\n--b%d\r\n' % (i, i)
        for i in range(levels)
    )
    tail = b"".join(b"\r\n--b%d--\r\n" % i for i in reversed(range(levels)))
    return (
        b"From: a@example.org\r\nSubject: deep\r\n"
        + head
        + b"Content-Type: text/plain\r\n\r\nhi"
        + tail
    )
