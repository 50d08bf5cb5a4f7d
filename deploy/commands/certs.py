"""`isthmus certs`: a job CA, one certificate per site, and the job token.

The CA key never leaves the output folder. A site certificate serves as server and
client (its coordinator and lanes, and dialing its peers) and names the site (CN and a
DNS name), ``isthmus.inter.security.TLS_NAME`` that channels check, and any --host.
EC P-256 keys: fast to make and to handshake with.
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import os
import secrets
from collections.abc import Sequence
from pathlib import Path

from isthmus.deploy.commands import add_command
from isthmus.deploy.config.job import ConfigError, load_config
from isthmus.inter.security import TLS_NAME

PRIVATE = 0o600
PUBLIC = 0o644
CLOCK_SKEW = datetime.timedelta(minutes=5)  # certificates valid a little before "now"


def _new_key():
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.generate_private_key(ec.SECP256R1())


def _key_pem(key) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _san(names: Sequence[str]):
    from cryptography import x509

    entries: list[x509.GeneralName] = []
    for name in dict.fromkeys(names):  # keep order, drop repeats
        try:
            entries.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            entries.append(x509.DNSName(name))
    return x509.SubjectAlternativeName(entries)


def make_certs(
    sites: Sequence[str], *, days: int = 365, hosts: Sequence[str] = (), job: str = "isthmus"
) -> dict[str, bytes]:
    """Create a job CA, a certificate per site and a token, in memory: file name ->
    content (ca.crt, ca.key, SITE.crt and SITE.key per site, token). ``hosts`` are extra
    names for every site certificate; ``job`` goes into the CA's common name."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    if days < 1:
        raise ValueError(f"--days must be >= 1, got {days}")
    if not sites or len(set(sites)) != len(sites):
        raise ValueError(f"need distinct site names, got {list(sites)}")
    now = datetime.datetime.now(datetime.timezone.utc)
    start, end = now - CLOCK_SKEW, now + datetime.timedelta(days=days)

    ca_key = _new_key()
    uses = ("digital_signature", "content_commitment", "key_encipherment", "data_encipherment")
    signs_only = dict.fromkeys((*uses, "key_agreement", "encipher_only", "decipher_only"), False)
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{job} job CA")])
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(**signs_only, key_cert_sign=True, crl_sign=True), True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), False)
        .sign(ca_key, hashes.SHA256())
    )
    files = {"ca.crt": ca_cert.public_bytes(serialization.Encoding.PEM), "ca.key": _key_pem(ca_key)}
    for site in sites:
        key = _new_key()
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, site)]))
            .issuer_name(ca_name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(start)
            .not_valid_after(end)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(_san([TLS_NAME, site, *hosts]), critical=False)
            .add_extension(
                x509.ExtendedKeyUsage(
                    [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
                ),
                critical=False,
            )
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), False
            )
            .sign(ca_key, hashes.SHA256())
        )
        files[f"{site}.crt"] = cert.public_bytes(serialization.Encoding.PEM)
        files[f"{site}.key"] = _key_pem(key)
    files["token"] = (secrets.token_urlsafe(32) + "\n").encode()
    return files


def write_certs(
    out: str | Path,
    sites: Sequence[str],
    *,
    days: int = 365,
    hosts: Sequence[str] = (),
    force: bool = False,
    job: str = "isthmus",
) -> list[Path]:
    """Create the files of `make_certs` in ``out``, keys and token mode 0600; returns the
    paths written, CA first."""
    try:
        files = make_certs(sites, days=days, hosts=hosts, job=job)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    folder = Path(out)
    existing = [name for name in files if (folder / name).exists()]
    if existing and not force:
        raise ConfigError(
            f"{folder} already holds {', '.join(existing)}; pass --force to replace them"
        )
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for name, content in files.items():
        path = folder / name
        mode = PRIVATE if name.endswith(".key") or name == "token" else PUBLIC
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (0 if force else os.O_EXCL)
        fd = os.open(path, flags, mode)
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), mode)  # an existing file (--force) keeps its old mode
            f.write(content)
        written.append(path)
    return written


def cmd_certs(args: argparse.Namespace) -> int:
    """create a job CA, a certificate per site and a job token

    Create the files for mutual TLS between sites and the job token (docs/security.md):
    ca.crt and ca.key, SITE.crt and SITE.key for every site, and token. Keys and token are
    written mode 0600. Existing files are not replaced without --force. Prints the
    [security] lines for the job config."""
    if args.sites and args.config:
        raise ConfigError("give --sites or --config, not both")
    if args.sites:
        sites = [s.strip() for s in args.sites.split(",") if s.strip()]
        job = "isthmus"
    else:
        config = load_config(args.config)
        sites, job = config.site_names, config.job.name
        if config.failover.witness:  # the witness's server is named like a site
            sites = [*sites, "witness"]
    out = Path(args.out).resolve()
    for path in write_certs(out, sites, days=args.days, hosts=args.host, force=args.force, job=job):
        print(f"wrote {path}")
    print(
        "\nCopy ca.crt, token and each site's SITE.crt and SITE.key to that site; ca.key stays"
        "\nhere. In the job config:\n"
        f'\n[security]\ncerts_dir = "{out}"\nrequire_tls = true\nrequire_token = true'
    )
    return 0


def register(sub: argparse._SubParsersAction, formatter: type[argparse.HelpFormatter]) -> None:
    parser = add_command(sub, formatter, "certs", cmd_certs)
    add = parser.add_argument
    add("--out", required=True, metavar="DIR", help="folder to write into")
    add(
        "--sites",
        metavar="SITE,SITE",
        help="site names (default: the job config's, site0, site1, ...)",
    )
    add("-c", "--config", metavar="TOML", help="take the sites from this job config")
    add("--days", type=int, default=365, help="validity of the certificates")
    add(
        "--host",
        action="append",
        default=[],
        metavar="NAME",
        help="extra DNS name or IP address for every site certificate (repeatable)",
    )
    add("--force", action="store_true", help="replace existing files")
