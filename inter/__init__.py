"""Between sites: coordinator, lanes, codecs, cross-site all-reduce."""
