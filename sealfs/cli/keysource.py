"""Which secret unlocks a volume, from the options, the environment and the header's slots.

The rule (README, "Keys"), first match wins:

1. `--recovery-key-file F`: the recovery key in F.
2. `--passphrase-file F`: the passphrase in F.
3. `--kms`, `--kms-key-id K` or `SEALFS_UNLOCK=kms`: the aws-kms slots (with
   `--kms-key-id`, only a slot made under K opens: KMS checks it).
4. `--pkcs11` or `SEALFS_UNLOCK=pkcs11`: the pkcs11 slots.
5. `SEALFS_UNLOCK=passphrase`: the passphrase (file from the environment,
   systemd credential, or a prompt).
6. Otherwise: the passphrase if a source is configured (`SEALFS_PASSPHRASE_FILE`
   or the `sealfs-passphrase` systemd credential); else the aws-kms slots if
   the volume has any; else the pkcs11 slots if it has any and a PIN source is
   configured; else a passphrase prompt.

In 3, 4 and 6, when KMS or the token fails and a passphrase source is
configured or a terminal can ask, the passphrase is tried next and the error,
if that fails too, names both causes.

Secrets never come from argv: files, environment variables naming files,
systemd's $CREDENTIALS_DIRECTORY, or a prompt on a terminal.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from collections.abc import Callable, Iterator

from sealfs.cli.paths import user_path
from sealfs.cli.secrets import (
    get_passphrase,
    passphrase_source,
    prompt_secret,
    read_secret_file,
    secret_origin,
    secret_source,
)
from sealfs.errors import ConfigError, KeyUnavailableError, NoSlotOfKindError, WrongKeyError
from sealfs.keys.header import VolumeHeader, decode_header
from sealfs.keys.hsm import Pin, Pkcs11Unlocker, TokenKey, create_token_key, pkcs11_slot_maker
from sealfs.keys.kms import KmsClients, KmsUnlocker, boto3_client_factory, kms_slot_maker
from sealfs.keys.recovery import RecoveryKeyFormatError, parse_recovery_key
from sealfs.keys.slots import (
    KIND_AWS_KMS,
    KIND_PKCS11,
    Passphrase,
    RecoveryKey,
    Secret,
    SlotMaker,
    Unlocked,
    unlock,
)
from sealfs.store.url import is_local_url, local_path

log = logging.getLogger("sealfs.cli")

UNLOCK_ENV = "SEALFS_UNLOCK"
UNLOCK_METHODS = ("auto", "passphrase", "kms", "pkcs11")
PIN_ENV = "SEALFS_PKCS11_PIN_FILE"
PIN_CREDENTIAL = "sealfs-pkcs11-pin"
MODULE_ENV = "SEALFS_PKCS11_MODULE"


def add_headless_options(p: argparse.ArgumentParser, *, kms_key_pin: bool = True) -> None:
    """Options to unlock with KMS or a PKCS#11 token (none of them carries a secret)."""
    p.add_argument(
        "--kms",
        action="store_true",
        help=f"unlock with the volume's aws-kms keyslots (or set {UNLOCK_ENV}=kms)",
    )
    if kms_key_pin:
        p.add_argument(
            "--kms-key-id",
            metavar="ARN|ALIAS",
            help="unlock with an aws-kms keyslot made under this KMS key only (implies --kms)",
        )
    p.add_argument(
        "--kms-endpoint",
        metavar="URL",
        help="KMS service URL (default: AWS_ENDPOINT_URL_KMS, AWS_ENDPOINT_URL, else AWS)",
    )
    p.add_argument(
        "--pkcs11",
        action="store_true",
        help=f"unlock with the volume's pkcs11 keyslots (or set {UNLOCK_ENV}=pkcs11)",
    )
    p.add_argument(
        "--pkcs11-module",
        type=user_path,
        metavar="PATH",
        help=f"PKCS#11 library to load (default: {MODULE_ENV}, else the one the slot names"
        " if it and the directories above it are root's or yours, writable by no one else)",
    )
    p.add_argument(
        "--pkcs11-pin-file",
        type=user_path,
        metavar="FILE",
        help=f"read the token PIN from this file (or {PIN_ENV}=FILE, or the"
        f" {PIN_CREDENTIAL} systemd credential)",
    )


def add_new_key_options(p: argparse.ArgumentParser) -> None:
    """Options that say which KMS key or token key a new slot uses."""
    p.add_argument(
        "--kms-region", metavar="REGION", help="region of the KMS key (default: from its ARN)"
    )
    p.add_argument("--pkcs11-token", metavar="LABEL", help="label of the PKCS#11 token")
    p.add_argument("--pkcs11-key", metavar="LABEL", help="label of the AES key on the token")
    p.add_argument(
        "--pkcs11-create-key",
        action="store_true",
        help="generate that AES key on the token first (non-extractable, 256 bits)",
    )


def add_init_key_options(p: argparse.ArgumentParser) -> None:
    """init: the KMS key and token key of the volume's aws-kms and pkcs11 slots."""
    p.add_argument(
        "--kms-key-id",
        metavar="ARN|ALIAS",
        help="also make an aws-kms keyslot with this KMS key; without a passphrase source"
        " the volume gets no passphrase slot (KMS plus the recovery key)",
    )
    p.add_argument(
        "--kms-endpoint",
        metavar="URL",
        help="KMS service URL (default: AWS_ENDPOINT_URL_KMS, AWS_ENDPOINT_URL, else AWS)",
    )
    p.add_argument(
        "--pkcs11-module",
        type=user_path,
        metavar="PATH",
        help="PKCS#11 library (for a pkcs11 slot)",
    )
    p.add_argument(
        "--pkcs11-pin-file",
        type=user_path,
        metavar="FILE",
        help=f"read the token PIN from this file (or {PIN_ENV}=FILE)",
    )
    add_new_key_options(p)


def passphrase_configured(args: argparse.Namespace) -> bool:
    """Whether a passphrase comes from a file, the environment or a credential (no prompt)."""
    return passphrase_source(getattr(args, "passphrase_file", None)) is not None


# --- secrets from files, the environment, systemd credentials or a prompt


def has_pin_source(args: argparse.Namespace) -> bool:
    return (
        secret_source(getattr(args, "pkcs11_pin_file", None), PIN_ENV, PIN_CREDENTIAL) is not None
    )


def get_pin(args: argparse.Namespace, token: str | None = None) -> Pin:
    """The token PIN: --pkcs11-pin-file, SEALFS_PKCS11_PIN_FILE, the credential, or a prompt."""
    explicit = getattr(args, "pkcs11_pin_file", None)
    source = secret_source(explicit, PIN_ENV, PIN_CREDENTIAL)
    if source is not None:
        return Pin(read_secret_file(source, "PKCS#11 PIN", secret_origin(explicit, PIN_ENV)))
    if not sys.stdin.isatty():
        raise ConfigError(
            f"no PKCS#11 PIN: give --pkcs11-pin-file FILE, set {PIN_ENV}=FILE, pass the"
            f" {PIN_CREDENTIAL} systemd credential, or run on a terminal to be asked"
        )
    label = f" for token {token!r}" if token else ""
    pin = prompt_secret(f"PKCS#11 PIN{label}: ", "PKCS#11 PIN")
    if not pin:
        raise ConfigError("the PIN must not be empty")
    return Pin(pin)


def module_override(args: argparse.Namespace) -> str | None:
    """--pkcs11-module (its type expanded a leading ~), else SEALFS_PKCS11_MODULE, whose
    ~ is expanded here."""
    option: str | None = getattr(args, "pkcs11_module", None)
    variable = os.environ.get(MODULE_ENV)
    return option or (user_path(variable) if variable else None)


def kms_clients(args: argparse.Namespace) -> KmsClients:
    return KmsClients(boto3_client_factory(getattr(args, "kms_endpoint", None)))


def recovery_secret(path: str) -> RecoveryKey:
    """The recovery key in the file at path. Raises WrongKeyError, ConfigError.

    A mistyped key is a wrong key (exit 3), not a damaged volume. The error names
    the file, never its text: that may be a passphrase given as the wrong file.
    """
    text = read_secret_file(path, "recovery key").decode(errors="replace")
    try:
        return RecoveryKey(parse_recovery_key(text))
    except RecoveryKeyFormatError as exc:
        raise WrongKeyError(f"recovery key in {path} {exc.problem}: check the file") from None


# --- choosing and trying


def _method(args: argparse.Namespace, pin_key: str | None) -> str:
    if getattr(args, "kms", False) or pin_key:
        return "kms"
    if getattr(args, "pkcs11", False):
        return "pkcs11"
    env = os.environ.get(UNLOCK_ENV, "").strip().lower() or "auto"
    if env not in UNLOCK_METHODS:
        raise ConfigError(f"{UNLOCK_ENV}={env} is not one of {', '.join(UNLOCK_METHODS)}")
    return env


def _has(header: VolumeHeader, kind: str) -> bool:
    return any(s.kind == kind for s in header.slots)


Attempt = Callable[[], Secret]
TYPED_TRIES = 3


def plan_unlock(
    args: argparse.Namespace,
    header: VolumeHeader,
    clients: KmsClients,
    *,
    use_kms_pin: bool = True,
) -> list[Attempt]:
    """The secrets to try, in order (each made only when its turn comes)."""
    if getattr(args, "recovery_key_file", None):
        return [lambda: recovery_secret(args.recovery_key_file)]
    if getattr(args, "passphrase_file", None):
        return [lambda: Passphrase(get_passphrase(args.passphrase_file, confirm=False))]
    pin_key = getattr(args, "kms_key_id", None) if use_kms_pin else None

    def kms() -> Secret:
        return KmsUnlocker(clients, pin_key)

    def pkcs11() -> Secret:
        return Pkcs11Unlocker(get_pin(args), module_override(args))

    def passphrase() -> Secret:
        return Passphrase(get_passphrase(None, confirm=False))

    can_ask = passphrase_source(None) is not None or sys.stdin.isatty()
    fallback = [passphrase] if can_ask else []
    method = _method(args, pin_key)
    if method == "kms":
        return [kms, *fallback]
    if method == "pkcs11":
        return [pkcs11, *fallback]
    if method == "passphrase" or passphrase_source(None) is not None:
        return [passphrase]
    if _has(header, KIND_AWS_KMS):
        return [kms, *fallback]
    if _has(header, KIND_PKCS11) and has_pin_source(args):
        return [pkcs11, *fallback]
    return [passphrase]


def unlock_header(
    args: argparse.Namespace, header_bytes: bytes, *, use_kms_pin: bool = True
) -> Unlocked:
    """Unlock the header by the rule above. Raises WrongKeyError, KeyUnavailableError, ..."""
    header = decode_header(header_bytes)
    with kms_clients(args) as clients:
        attempts = plan_unlock(args, header, clients, use_kms_pin=use_kms_pin)
        first: WrongKeyError | KeyUnavailableError | None = None
        for i, attempt in enumerate(attempts):
            try:
                unlocked = _unlock_asking_again(args, header_bytes, attempt)
            except (WrongKeyError, KeyUnavailableError) as exc:
                if i == len(attempts) - 1:
                    text = str(exc) if first is None else f"{first}; then: {exc}"
                    raise type(exc)(f"volume at {_volume_named(args)}: {text}") from None
                first = first or exc
                continue
            if first is not None:  # said only now, so that a failure stays one line
                log.warning("%s; unlocked with the passphrase instead", first)
            return unlocked
    raise AssertionError("unreachable")


def _unlock_asking_again(
    args: argparse.Namespace, header_bytes: bytes, attempt: Attempt
) -> Unlocked:
    """unlock with attempt's secret; a passphrase typed at the prompt that opens no slot is
    asked for again, up to TYPED_TRIES times in all (a typo ended the command at once,
    as neither sudo nor cryptsetup does). Each try costs an Argon2 run."""
    for tries in range(1, TYPED_TRIES + 1):
        secret = attempt()
        try:
            return unlock(header_bytes, secret)
        except WrongKeyError as exc:
            if (
                tries == TYPED_TRIES
                or isinstance(exc, NoSlotOfKindError)
                or not _typed(args, secret)
            ):
                raise
            print("sealfs: wrong passphrase: try again", file=sys.stderr, flush=True)
    raise AssertionError("unreachable")


def _typed(args: argparse.Namespace, secret: Secret) -> bool:
    """Whether secret is a passphrase typed at the prompt (one from a file or a systemd
    credential would only fail the same way again)."""
    return (
        isinstance(secret, Passphrase)
        and not getattr(args, "passphrase_file", None)
        and passphrase_source(None) is None
        and sys.stdin.isatty()
    )


def unlocker_for_rekeys(
    args: argparse.Namespace, unlocked: Unlocked
) -> Callable[[bytes], Unlocked] | None:
    """How a read-only mount's daemon unlocks the header of a later rekey by itself.

    With the kind of secret that unlocked the mount, read again from the same
    file, KMS or token when the rekey comes: the daemon keeps no secret in memory
    for it (a PIN or passphrase is read, used and dropped). None for one typed
    on a terminal. Paths are made absolute now: the daemon runs in /.
    """
    secret = unlocked.secret
    if isinstance(secret, RecoveryKey):
        recovery_file = os.path.abspath(args.recovery_key_file)
        return lambda data: unlock(data, recovery_secret(recovery_file))
    if isinstance(secret, Passphrase):
        source = passphrase_source(getattr(args, "passphrase_file", None))
        if source is None:
            return None
        passphrase_file = os.path.abspath(source)
        return lambda data: unlock(data, Passphrase(get_passphrase(passphrase_file, confirm=False)))
    if isinstance(secret, KmsUnlocker):
        pinned = secret.pinned_key_id

        def with_kms(data: bytes) -> Unlocked:
            with kms_clients(args) as clients:
                return unlock(data, KmsUnlocker(clients, pinned))

        return with_kms
    if isinstance(secret, Pkcs11Unlocker):
        pin_source = secret_source(getattr(args, "pkcs11_pin_file", None), PIN_ENV, PIN_CREDENTIAL)
        if pin_source is None:
            return None
        pin_file = os.path.abspath(pin_source)
        # --pkcs11-module or SEALFS_PKCS11_MODULE may be relative too (None: the header's,
        # which must be absolute).
        module = os.path.abspath(secret.module) if secret.module else None
        return lambda data: unlock(
            data, Pkcs11Unlocker(Pin(read_secret_file(pin_file, "PKCS#11 PIN")), module)
        )
    return None


def _volume_named(args: argparse.Namespace) -> str:
    """The store an unlock failed for, as its error names it.

    "wrong passphrase" alone left a host that unlocks a volume per agent (one
    log, one journal) to guess which; a local path is made absolute for that reader.
    """
    store: str = args.store
    return str(local_path(store)) if is_local_url(store) else store


# --- new slots for init, key add, key rotate


@contextlib.contextmanager
def init_slot_makers(args: argparse.Namespace) -> Iterator[list[SlotMaker]]:
    """The KMS and PKCS#11 slots init was asked for (none: empty), with clients open."""
    with kms_clients(args) as clients:
        makers: list[SlotMaker] = []
        if args.kms_key_id:
            makers.append(kms_slot_maker(clients, args.kms_key_id, args.kms_region))
        if args.pkcs11_token or args.pkcs11_key:
            makers.append(token_slot_maker(args))
        yield makers


def token_slot_maker(args: argparse.Namespace, default: TokenKey | None = None) -> SlotMaker:
    """A pkcs11 SlotMaker from --pkcs11-module/-token/-key (defaults from an old slot)."""
    module = module_override(args) or (default.module if default else None)
    token = args.pkcs11_token or (default.token if default else None)
    key = args.pkcs11_key or (default.key if default else None)
    if not (module and token and key):
        raise ConfigError(
            "a pkcs11 keyslot needs --pkcs11-module PATH (or"
            f" {MODULE_ENV}), --pkcs11-token LABEL and --pkcs11-key LABEL"
        )
    where = TokenKey(os.path.abspath(module), token, key)
    pin = get_pin(args, token)
    if args.pkcs11_create_key:
        create_token_key(where, pin)
    return pkcs11_slot_maker(where, pin)


def kms_maker(clients: KmsClients, key_id: str | None, region: str | None) -> SlotMaker:
    if not key_id:
        raise ConfigError("an aws-kms keyslot needs --kms-key-id ARN|ALIAS")
    return kms_slot_maker(clients, key_id, region)
