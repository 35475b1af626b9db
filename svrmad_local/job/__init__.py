"""The resumable job that fills a run folder with a model: `svrmad run` (its flags, checks and Job) and
`svrmad merge`."""
