"""A repository taken from a system path when present, else from a pinned archive."""

def _system_or_archive_impl(ctx):
    path = ctx.path(ctx.attr.system_path)
    if path.exists:
        for child in path.readdir():
            ctx.symlink(child, child.basename)
        return
    if not ctx.attr.urls:
        fail("%s: %s is missing and no archive is pinned; install Debian's bazel-bootstrap" %
             (ctx.name, ctx.attr.system_path))
    ctx.download_and_extract(ctx.attr.urls, sha256 = ctx.attr.sha256, stripPrefix = ctx.attr.strip_prefix)

system_or_archive = repository_rule(
    implementation = _system_or_archive_impl,
    attrs = {
        "system_path": attr.string(mandatory = True),
        "urls": attr.string_list(),
        "sha256": attr.string(),
        "strip_prefix": attr.string(),
    },
    local = True,
)
