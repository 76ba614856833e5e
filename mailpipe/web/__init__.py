"""The operator's console and the job status API (`mailpipe web`): server-rendered pages over
`mailpipe.operations`, behind HTTP basic auth. Above the operations and the Celery face, below the
command line, which imports it only for `mailpipe web`."""
