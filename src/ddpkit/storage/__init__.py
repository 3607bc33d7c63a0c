"""Where a run lives: a local folder, or a prefix in an object store (s3://, gs://, az://).

A bucket has no rename, so the local disk's publish-by-rename does not carry over: an object
store run keeps a local staging folder where the usual atomic writes happen, and each
checkpoint is copied to the bucket object by object with its manifest written last
(remote.py). A checkpoint whose manifest is missing does not exist for any reader.
"""
