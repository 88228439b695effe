"""Writes the mini world into AppWorld DBs through the apps' own SQLModel classes.

Rows go through `create` (the apps' validators) and `save_all` (record hashes, search
text), so the DBs look exactly like ones AppWorld generated itself. Imports appworld:
only the builder process uses this module.
"""

import datetime
import json
import os

from appworld.api_docs import prepare_api_docs
from appworld.apps import get_all_apps
from appworld.common.constants import CANARY_STRING

from sage_jax.envs.appworld.mini import content

# Apps in which every person holds an account (the supervisor's passwords list them).
ACCOUNT_APPS = ("phone", "venmo", "spotify", "simple_note", "todoist", "file_system")


def _at(days: float) -> datetime.datetime:
  return content.BASE_TIME + datetime.timedelta(days=days)


def _save(model, rows: list[dict]) -> list:
  records = [model.create(**row) for row in rows]
  model.save_all(records)
  return records


def write_api_docs(models, data_dir: str) -> None:
  """Fills the api_docs app DB and data/api_docs/standard/<app>.json."""
  directory = os.path.join(data_dir, "api_docs", "standard")
  os.makedirs(directory, exist_ok=True)
  rows = []
  for app in get_all_apps(skip_admin=True):
    docs = prepare_api_docs(app)
    with open(os.path.join(directory, f"{app}.json"), "w") as f:
      json.dump({d["api_name"]: {**d, "canary_string": CANARY_STRING} for d in docs}, f,
                indent=2)
    for doc in docs:
      row = dict(doc)
      row["app_name_"] = row.pop("app_name")
      rows.append(row)
  _save(models.api_docs.ApiDoc, rows)


def _users(models, world: content.World) -> dict[str, dict[str, int]]:
  """Creates every person's accounts; returns app -> email -> user id."""
  people = world.people
  _save(models.admin.MainUser, [
    dict(first_name=p.first_name, last_name=p.last_name, email=p.email,
         phone_number=p.phone_number, birthday=p.birthday, sex=p.sex) for p in people])
  main_ids = {u.email: u.id for u in models.admin.MainUser.all()}
  _save(models.admin.AccountPassword, [
    dict(main_user_id=main_ids[p.email], account_name=app, password=p.password)
    for p in people for app in ACCOUNT_APPS])
  ids = {}
  for app in ACCOUNT_APPS:
    rows = []
    for i, p in enumerate(people):
      row = dict(first_name=p.first_name, last_name=p.last_name, password=p.password,
                 created_at=_at(-400 + 7 * i), last_logged_in=_at(-3))
      if app == "phone":
        row["phone_number"] = p.phone_number
      else:
        row.update(email=p.email, verified=True)
      if app == "venmo":
        row["venmo_balance"] = content.VENMO_BALANCE
      rows.append(row)
    records = _save(models[app].User, rows)
    ids[app] = {p.email: r.id for p, r in zip(people, records, strict=True)}
  return ids


def _spotify(models, world: content.World, ids: dict[str, int]) -> None:
  spotify = models.spotify
  artists = _save(spotify.Artist, [
    dict(name=name, genre=genre, created_at=_at(-900))
    for name, (genre, _, _) in content.CATALOG.items()])
  artist_id = {a.name: a.id for a in artists}
  albums = _save(spotify.Album, [
    dict(title=album, artist_ids=[artist_id[name]], genre=genre,
         release_date=_at(-300 - 60 * i))
    for i, (name, (genre, album, _)) in enumerate(content.CATALOG.items())])
  album_id = {a.title: a.id for a in albums}
  songs = _save(spotify.Song, [
    dict(title=s.title, artist_ids=[artist_id[s.artist]], album_id=album_id[s.album],
         duration=s.duration, genre=s.genre, release_date=_at(-300 - 7 * i),
         play_count=1000 + 137 * i)
    for i, s in enumerate(world.songs)])
  song_id = {s.title: s.id for s in songs}
  for email, holdings in world.holdings.items():
    user_id = ids[email]
    _save(spotify.UserLibrarySong, [
      dict(user_id=user_id, song_id=song_id[t], created_at=_at(i))
      for i, t in enumerate(holdings.library)])
    for j, (title, tracks) in enumerate(holdings.playlists.items()):
      (playlist,) = _save(spotify.Playlist, [
        dict(title=title, user_id=user_id, created_at=_at(j), is_public=j == 0)])
      _save(spotify.PlaylistSong, [
        dict(playlist_id=playlist.id, song_id=song_id[t], added_at=_at(j + 0.1 * k))
        for k, t in enumerate(tracks)])


def _venmo(models, world: content.World, ids: dict[str, int]) -> None:
  _save(models.venmo.Transaction, [
    dict(sender_id=ids[p.sender], receiver_id=ids[p.receiver], amount=p.amount,
         description=p.description, created_at=_at(p.day), updated_at=_at(p.day))
    for holdings in world.holdings.values() for p in holdings.payments])


def _phone(models, world: content.World, ids: dict[str, int]) -> None:
  rows = []
  for email, holdings in world.holdings.items():
    for contact_email, relationship in holdings.contacts:
      p = world.person(contact_email)
      rows.append(dict(user_id=ids[email], first_name=p.first_name, last_name=p.last_name,
                       email=p.email, phone_number=p.phone_number,
                       relationships=[relationship], birthday=p.birthday,
                       created_at=_at(-200)))
  _save(models.phone.Contact, rows)


def _simple_note(models, world: content.World, ids: dict[str, int]) -> None:
  _save(models.simple_note.Note, [
    dict(user_id=ids[email], title=title, content=text, tags=list(tags),
         created_at=_at(i), updated_at=_at(i))
    for email, holdings in world.holdings.items()
    for i, (title, tags, text) in enumerate(holdings.notes)])


def _todoist(models, world: content.World, ids: dict[str, int]) -> None:
  todoist = models.todoist
  for email, holdings in world.holdings.items():
    user_id = ids[email]
    names = ["Inbox", *holdings.projects]
    projects = _save(todoist.Project, [
      dict(user_id=user_id, name=name, is_inbox=name == "Inbox", created_at=_at(-30),
           color="charcoal" if name == "Inbox" else content.PROJECT_COLORS[i - 1])
      for i, name in enumerate(names)])
    _save(todoist.ProjectCollaboratorLink, [
      dict(project_id=p.id, user_id=user_id, created_at=_at(-30)) for p in projects])
    project_id = {p.name: p.id for p in projects}
    _save(todoist.Task, [
      dict(project_id=project_id[name], user_id=user_id, title=todo.title,
           priority=todo.priority, is_completed=todo.completed, order_index=k,
           created_at=_at(-20 + k))
      for name, todos in holdings.projects.items() for k, todo in enumerate(todos)])


def home(person: content.Person) -> str:
  return f"/home/{person.first_name.lower()}/"


def _file_system(models, world: content.World, ids: dict[str, int]) -> None:
  fs = models.file_system
  for p in world.people:
    directories = ["/", "/home/", home(p)]
    holdings = world.holdings.get(p.email)
    if holdings is not None:
      directories += [home(p) + d + "/" for d in holdings.files]
    _save(fs.Directory, [
      dict(path=path, user_id=ids[p.email], created_at=_at(-365), updated_at=_at(-365))
      for path in directories])
    if holdings is not None:
      _save(fs.File, [
        dict(path=home(p) + d + "/" + name, user_id=ids[p.email], content=text,
             created_at=_at(-100 + k), updated_at=_at(-100 + k))
        for d, entries in holdings.files.items() for k, (name, text) in enumerate(entries)])


def populate(models, world: content.World) -> None:
  """Fills the (empty, freshly created) base DBs with the world."""
  ids = _users(models, world)
  _spotify(models, world, ids["spotify"])
  _venmo(models, world, ids["venmo"])
  _phone(models, world, ids["phone"])
  _simple_note(models, world, ids["simple_note"])
  _todoist(models, world, ids["todoist"])
  _file_system(models, world, ids["file_system"])


def add_supervisor(models, supervisor: content.Person, instruction: str) -> None:
  """Per-task supervisor rows: profile, account passwords and the active task."""
  app = models.supervisor
  (record,) = _save(app.Supervisor, [
    dict(first_name=supervisor.first_name, last_name=supervisor.last_name,
         email=supervisor.email, phone_number=supervisor.phone_number,
         birthday=supervisor.birthday, sex=supervisor.sex)])
  _save(app.AccountPassword, [
    dict(supervisor_id=record.id, account_name=name, password=supervisor.password)
    for name in ACCOUNT_APPS])
  _save(app.Task, [dict(supervisor_id=record.id, instruction=instruction)])
