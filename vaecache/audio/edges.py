"""The audio kind at vaecache's edges, importable without torch: `vaecache embed --audio-vae` and its flags, the
request they make, encode's --audio-vae (checked at start-up, its camera against the scenes found, embedded once the
cache is finished) and the lines a run prints of an audio set."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vaecache.edges import EmbedShared, KindEdges, KindOption
from vaecache.errors import UsageError

if TYPE_CHECKING:
    from vaecache.cache.kinds import SetOutcome


class AudioEdges(KindEdges):
    kind = "audio"
    panel = "Sound (--audio-vae)"
    asked_by = "audio_vae"
    takes_set_name = True
    items = "item(s)"
    options = (
        KindOption("audio_vae", "--audio-vae", str, "Encode each clip's sound: diffusers:DIR | FILE.", metavar="SPEC"),
        KindOption("audio_camera", "--audio-camera", str, "Whose sound (default: the first with a track).",
                   metavar="CAM"),
        KindOption("audio_missing", "--audio-missing", str, "A clip without sound: skip (default) | silence.",
                   metavar="TEXT"),
    )

    def check_given(self, given: dict[str, Any], shared: EmbedShared) -> None:
        if given["audio_vae"] is None and (given["audio_camera"] is not None or given["audio_missing"] is not None):
            raise UsageError(f"{'--audio-camera' if given['audio_camera'] is not None else '--audio-missing'} "
                             "applies to --audio-vae")

    def request(self, given: dict[str, Any], shared: EmbedShared) -> Any:
        from vaecache.audio.embed import AudioRequest

        return AudioRequest(
            out=shared.out, audio_vae=given["audio_vae"], camera=given["audio_camera"],
            missing=given["audio_missing"] or "skip", set_name=shared.set_name or "default", replace=shared.replace,
            shard_bytes=shared.shard_bytes, device=shared.device, allow_pickle_weights=shared.allow_pickle_weights,
            storage_options=shared.storage_options)

    def encode_request(self, cfg: Any) -> Any | None:
        if not cfg.audio.vae:
            return None
        from vaecache.audio.embed import AudioRequest

        return AudioRequest(
            out=str(cfg.out.location), audio_vae=cfg.audio.vae, camera=cfg.audio.camera, missing=cfg.audio.missing,
            device=cfg.parallel.device, allow_pickle_weights=cfg.vae.allow_pickle_weights,
            storage_options=cfg.out.storage_options)

    def check_at_start(self, request: Any) -> None:
        if request.audio.vae is not None:
            from vaecache.audio.embed import check_audio_vae

            check_audio_vae(request.audio.vae)

    def check_scenes(self, request: Any, scenes: Any) -> None:
        camera = request.audio.camera if request.audio.vae is not None else None
        if camera is not None and scenes and not any(camera in scene.cameras for scene in scenes):
            cameras = sorted({name for scene in scenes for name in scene.cameras})
            raise UsageError(f"--audio-camera {camera}: no scene of {request.source.location} has that camera "
                             f"(cameras: {', '.join(cameras)})")

    def counts(self, outcome: SetOutcome) -> str:
        return (f"{outcome.extra['clips']} clips, {outcome.extra.get('skipped', 0)} skipped, "
                f"{outcome.extra.get('silenced', 0)} silenced (without sound)")

    def notes(self, outcome: SetOutcome) -> list[str]:
        left = {what: outcome.extra[what] for what in ("skipped", "silenced") if outcome.extra.get(what)}
        if not left:
            return []
        named = outcome.extra.get("without_sound") or []
        lines = ["clips without sound: " + ", ".join(f"{count} {what}" for what, count in left.items()),
                 *(f"  {clip}: {reason}" for clip, reason in named)]
        more = sum(left.values()) - len(named)
        if more > 0:
            lines.append(f"  ... and {more} more (vaecache inspect {outcome.extra.get('out')} lists them)")
        return lines


EDGES = AudioEdges()
